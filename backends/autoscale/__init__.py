"""Elastic pools' execution: the executor that carries the planner's plans out (start, stop, sleep,
wake, drain) on a device budget, and the `autoscale:` configuration a pool holds. The decisions live
in `policies.autoscale`. docs/autoscaling.md."""
