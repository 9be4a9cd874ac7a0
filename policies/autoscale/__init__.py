"""Elastic pools' decisions: how many replicas each pool and role wants (the planners), what the
devices allow (the budget), scheduled floors and the forecasts they read. Pure functions over
frozen values; `backends.autoscale` carries the plans out. docs/autoscaling.md; README.md here."""
