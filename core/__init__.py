"""Device-agnostic engine: scheduler, KV cache manager, models, sampler, server."""
