"""Gateway replicas that act as one: each publishes what it sent where, and folds in the others'.

With `state: redis`, every replica appends small batches to one Redis stream: its in-flight load
per shared endpoint (requests, prefill and decode tokens), the approximate prefix index's block
keys of each dispatch, and the session pins. Every replica reads the stream and folds the others'
entries into its own view (`InFlight.remote_*`, the prefix index, the session table), so N
replicas behind a plain L4 balancer route as one would. See docs/scale-out.md.
"""
