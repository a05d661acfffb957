"""Structured output: constraints (params.py), compiled once each with
llguidance (compiler.py), held back while compiling (pending.py), applied to
the logits as a token mask every step (mask.py)."""
