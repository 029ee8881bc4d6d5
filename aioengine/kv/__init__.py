"""The paged KV cache's bookkeeping: the block pool, per-request block tables, the prefix
cache, KV cache groups and sliding windows."""
