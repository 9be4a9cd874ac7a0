"""Replay benchmark of routers over a simulated fleet (phase 2), and the routing micro-benchmark."""
