"""Spill-over from a self-hosted pool sized for the mean to a hosted API: SLO attainment and $/Mtok."""
