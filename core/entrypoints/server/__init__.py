"""The OpenAI-compatible API server: app (FastAPI), protocol (request
bodies), metrics (Prometheus text), cli (`paged serve`)."""
