"""Tests of the simulated engine (sim)."""
