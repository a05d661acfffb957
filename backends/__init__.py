"""Per-device attention backends and op wrappers, plus the pure-torch reference."""
