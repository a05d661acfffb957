"""Platform interface, built-in platforms (cpu, cuda, npu) and the registry."""
