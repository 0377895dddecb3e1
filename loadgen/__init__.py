"""loadgen package."""
