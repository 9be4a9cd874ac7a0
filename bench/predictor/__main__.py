"""`python -m bench.predictor`: the benchmark of run.py (`--help` lists its options)."""

from bench.predictor.run import main

main()
