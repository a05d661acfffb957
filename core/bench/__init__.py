"""The benchmark client (`paged bench serve`)."""
