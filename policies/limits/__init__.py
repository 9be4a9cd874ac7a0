"""Token-aware admission: buckets, budgets and concurrency leases in memory or Redis."""
