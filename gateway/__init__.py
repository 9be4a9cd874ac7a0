"""The gateway room: bytes in and out, accounting, telemetry, admin API and CLI."""

__version__ = "0.1.0"
