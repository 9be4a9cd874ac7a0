"""Transports: where the walk sends a routed request (`gateway/request/context.py` is the seam).

`engine.py` relays to an engine over HTTP (with its PD prefill leg and its failover to a fallback
model; a stream cut mid-way continues on another replica through `gateway/upstream/replica_loss.py`);
`observers.py` holds the hooks that watch each attempt (route metrics, tool boundaries, the
predictor's learning). The endpoint picker's transport is in
`gateway/epp/decide.py`, a batch line's in `gateway/batch/lines.py`.
"""
