"""The orchestrator: the public Generate API, the draft → verify loop, the
adaptive speculation policy, routing over draft and target replicas, and
streamed detokenization. Imports only the foundation (specdec)."""
