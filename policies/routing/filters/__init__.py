"""Filters: one module each, each removes candidates that must not serve a request."""
