"""Pickers: one module each, each chooses one candidate from the weighted scores."""
