"""Prefix indexes: which endpoint holds which prompt prefix in its KV cache."""
