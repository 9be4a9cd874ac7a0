"""The gateway's side of elastic pools: what it tells the planner (traffic), the planning loop, the
cold-start hold, and where they join the walk of a request (docs/autoscaling.md)."""
