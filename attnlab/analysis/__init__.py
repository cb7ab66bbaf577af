"""Measured analyses of attention (numerical rank, ...): functions that return numbers."""
