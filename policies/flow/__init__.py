"""Flow control under saturation: who goes next when a pool's engines are full.

Pure decisions over plain values (the waiting room itself, with its futures and timers, is the
gateway's: `gateway/flow/`):

- `order`: the next request: strict priority bands (critical > high > normal > low > sheddable), then
  virtual token counters (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24) per
  (pool, band, tenant), the tenant with the least weighted service first and a returning tenant
  starting at the band's minimum, then program-fair queueing inside a tenant; the counters' in-memory
  store and each tenant's service share over a sliding window;
- `redis_counters`: the counters and the programs' attained service shared by replicas through Redis;
- `saturation`: can an endpoint start a request now (work-conserving: nothing waits while one can),
  the slot reserves, preemption, and gateway.yaml's `flow_control` section;
- `room`: policies.yaml's per-band waits, which request is shed when a pool's waiting room is full,
  an honest retry-after, and what a request that leaves undispatched is told.
"""
