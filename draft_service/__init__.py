"""The draft service: drafters on ONNX Runtime (a same-tokenizer model, a
different-tokenizer model mapped losslessly onto the target's vocabulary) and
model-free ones (prompt lookup), with per-session KV caches, unary Propose
and Session streams that draft ahead. Imports only the foundation (specdec)."""
