"""bench/kv_tiers: tier-aware prefix routing on a fleet with a host-DRAM KV tier (see run.py)."""
