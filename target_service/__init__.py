"""The target service: the big model on torch + transformers, per-session KV
caches, exact verification and rollback, batching across sessions, and the
start-up calibration that picks its numerics. Imports only the foundation
(specdec)."""
