"""What an engine of a given model on given hardware is, as numbers: shapes, datasheets, the fitted
step-time roofline and KV capacity.

The simulated engine (`sim`) runs on these, and the latency predictor's prior is computed
from them, so neither imports the other: recalibrating the simulator (`hardware.py`'s fitted factors)
is a change to the prior that the import contract can see.
"""
