"""PD pairing across a two-rack topology (bench/pd_topology/run.py)."""
