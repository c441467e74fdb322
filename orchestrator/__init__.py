"""The orchestrator: the public API and the draft → verify loop."""
