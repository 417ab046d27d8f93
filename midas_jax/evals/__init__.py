"""Evaluation suites run on a saved checkpoint (`midas eval`) and the run report (`midas report`).

Each suite is a module with `run_suite(model, workdir, out_dir, options) -> dict`, registered by
name in `suites.py`; `options.py` holds the options they share, `figures.py` the charts they draw.
"""
