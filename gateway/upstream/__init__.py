"""The upstream side: the pooled client to the engines, the relay, engine fields and errors, stalls, migration."""
