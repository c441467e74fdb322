"""The OpenAI-compatible HTTP gateway: ``POST /v1/chat/completions`` and
``/v1/completions`` (JSON or SSE), ``GET /v1/models``, health and readiness,
in front of the orchestrator's gRPC ``Generate``. Starlette + sse-starlette
on uvicorn; imports only the foundation (specdec)."""
