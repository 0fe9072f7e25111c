"""Automatic scaling: GBS forecasting, candidate allocations, planner."""
