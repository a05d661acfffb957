"""Tensor parallelism over torch.distributed (docs/distributed.md): the
sharding math (sharding.py), the rank group and its collectives (group.py),
the model's parallel hooks (parallel_ops.py) and the step broadcast from
rank 0 (follower.py)."""
