"""Agent programs: request-level vs program-fair queueing on a saturated pool (`python -m bench.agents`),
and run budgets across two gateway replicas, their overshoot (`python -m bench.agents.budgets`)."""
