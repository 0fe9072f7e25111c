"""Adaptive batching: gradient similarity, noise scale, GBS policy, LR scaling."""
