"""Agent programs on a saturated pool: request-level vs program-fair queueing (`python -m bench.agents`)."""
