"""Predictor accuracy and SLO attainment on the simulated fleet (see run.py)."""
