"""Tensor parallelism over torch.distributed (docs/distributed.md): the
sharding math (sharding.py), the rank group and its collectives (group.py),
ranks as threads of one process for tests (local_group.py), the model's
meeting points (parallel_ops.py), the launch layout (layout.py) and a
follower rank's loop (rank.py)."""
