"""Chaos benchmark: the gateway's promises under faults and hostile input (`python -m bench.chaos`)."""
