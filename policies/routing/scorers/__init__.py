"""Scorers: one module each, each class scores candidates in [0, 1] (higher is better)."""
