"""Calibration of the simulated engine's performance model against published serving runs.

Run ``python -m bench.sim_calibration --fit --write-presets`` from the repository root to refit the
efficiency factors in backends/perf/hardware.py, or without flags to score the presets as they are.
Either way it writes bench/results/sim-calibration.md and sim-calibration.png. The runs and their
sources are in public.py; scenarios.py replays them; serving.py fits; fit.py scores the step-time
cross-checks (kernel sums, 2023-24 engines).
"""
