"""Evaluation suites run on a saved checkpoint (`midas eval`) and the run report (`midas report`).

Each suite is `run_suite(model, workdir, out_dir, options) -> dict`, registered by name in
`suites.py` and imported only when it runs, so importing this package costs nothing.
"""
