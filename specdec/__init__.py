"""The foundation every service builds on, and nothing else.

Errors and their gRPC status codes, the exact sampling math, gRPC server and
channel helpers, TLS and bearer-token auth, Prometheus metrics, structured
logging, tokenization, model specs and their preparation (``specdec.models``),
file-system helpers, the command-line plumbing the services share, and the
generated ``specdec.v1`` protocol code. This package imports no service and
no entry point (the layering contract in pyproject.toml, checked by
``lint-imports`` in scripts/test.sh).
"""
