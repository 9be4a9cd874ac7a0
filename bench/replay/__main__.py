"""`python -m bench.replay`: the benchmark of run.py (`--help` lists its options)."""

from bench.replay.run import main

raise SystemExit(main())
