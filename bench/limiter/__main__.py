"""`python -m bench.limiter`: the benchmark of run.py (`--help` lists its options)."""

from bench.limiter.run import main

main()
