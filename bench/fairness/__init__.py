"""Fairness under saturation: FIFO, priority only and flow control side by side (`python -m bench.fairness`)."""
