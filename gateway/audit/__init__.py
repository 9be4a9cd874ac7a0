"""The audit log of admin changes: who changed what, when, before and after (README.md)."""
