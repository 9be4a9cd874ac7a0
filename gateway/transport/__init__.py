"""Transports: where the walk sends a routed request (`gateway/request/transport.py` is the seam).

`engine.py` relays to an engine over HTTP (`pd.py` its PD prefill leg; a stream cut mid-way
continues on another replica through `gateway/upstream/migrate.py`); `observers.py` holds the hooks
that watch each attempt (route metrics). The endpoint picker's transport is in
`gateway/epp/decide.py`, a batch line's in `gateway/batch/walk.py`.
"""
