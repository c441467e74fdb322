"""The target service: the big model, per-session KV caches, exact verification."""
