"""Tool-boundary affinity benchmark: next-turn prefix hits of agent programs on a saturated pool."""
