"""Batch work: when it may run (spare capacity) and what it costs (the batch price)."""
