"""The engine: scheduler, KV cache manager, model runner, sampler, the Worker seam."""
