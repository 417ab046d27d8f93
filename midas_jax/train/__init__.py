"""Training: the step, the loop, and what it records (metrics, progress)."""
