"""Keys and tenants made through the admin API: records, stores (memory, SQLite, Redis) and the in-memory directory."""
