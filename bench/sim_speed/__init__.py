"""How much host CPU the simulated engine spends per generated token, and whether it keeps up with
wall-clock time (`python -m bench.sim_speed.run`)."""
