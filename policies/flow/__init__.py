"""Flow control under saturation: who goes next when a pool's engines are full.

Pure decisions over plain values (the waiting room itself, with its futures and timers, is the
gateway's: `gateway/flow/`):

- `bands`: strict priority bands, critical > high > normal > low > sheddable;
- `vtc`: virtual token counters (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24)
  per (pool, band, tenant): the tenant with the least weighted service goes first, a returning tenant
  starts at the band's minimum;
- `order`: the next request, as a pure function of what waits and the counters;
- `saturation`: can an endpoint start a request now (work-conserving: nothing waits while one can);
- `bounds`: which request is shed when a pool's waiting room is full, and an honest retry-after;
- `share`: service per tenant over a sliding window, and its ratio to the tenant's fair share;
- `counters` / `redis_counters`: where the counters live (memory, or Redis shared by replicas);
- `config`: gateway.yaml's `flow_control` section (saturation limits and room sizes per pool).
"""
