"""`python -m bench.overhead`: the benchmark of run.py (`--help` lists its options)."""

from bench.overhead.run import main

raise SystemExit(main())
