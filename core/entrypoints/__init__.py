"""Entry points: the CLI, the OpenAI-compatible server, the offline LLM API."""
