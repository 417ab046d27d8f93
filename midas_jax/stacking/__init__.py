"""Depth growth by stacking (MIDAS, GradStack and friends).

`operators` computes, for a growth step, which old layer each new layer copies (the provenance map);
growing a TrainState is then one gather along the `layers` axis (docs/architecture.md#growth-is-a-gather).
`schedule` decides when growth happens (Prop-alpha stage lengths) and what it saves in FLOPs.
Both are pure numpy/Python: no JAX, no TF, usable from notebooks and the CLI alike.
"""
