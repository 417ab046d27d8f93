"""Depth growth by stacking (MIDAS, GradStack and friends).

`operators` computes, for a growth step, which old layer each new layer copies (the provenance map),
and names an optional transform of the grown state (`preserve`: new layers start as the identity);
growing a TrainState is then one gather along the `layers` axis (docs/architecture.md#growth-is-a-gather).
`schedule` decides when growth happens (Prop-alpha stage lengths) and what it saves in FLOPs;
`checks` computes a run's schedule once and refuses settings that cannot describe the run; `grow`
applies a provenance map to a TrainState. A library of pure functions: the train loop's stage
controller (train/stages.py) is what calls them during a run.
"""
