"""Tests of the backends room."""
