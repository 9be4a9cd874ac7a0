"""`python -m bench.keys`: the benchmark of run.py (`--help` lists its options)."""

from bench.keys.run import main

raise SystemExit(main())
