"""Tests of the simulated engine (backends/sim)."""
