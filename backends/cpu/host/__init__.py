"""The CPU host: topology, CPU lists and load, thread pinning plans, NUMA memory, ISA levels."""
