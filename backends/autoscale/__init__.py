"""Elastic pools: the planner (how many replicas, per pool and role) and the executor that carries
its decisions out (start, stop, sleep, wake, drain) on a device budget. docs/autoscaling.md."""
