"""Performance model: compute, all-reduce and iteration time (numpy only, no torch)."""
