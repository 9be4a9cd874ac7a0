"""`python -m bench.sim_speed`: the benchmark of run.py (`--help` lists its options)."""

from bench.sim_speed.run import main

main()
