"""The walk of one request through the gateway, traced before and after a refactor (issue 40's measure)."""
