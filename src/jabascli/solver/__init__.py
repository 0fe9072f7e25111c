"""Configuration solver (numpy only, no torch)."""
