"""Profilers: memory, computation, gradient buckets, all-reduce."""
