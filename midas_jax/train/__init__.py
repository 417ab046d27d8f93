"""Training: a stage's build and step, the stage controller, the loop, resuming, and what a run records."""
