"""Primitive accuracy with a grown model's middle block looped r times at inference.

Kapl et al. (2026) report that looping the middle blocks of a depth-grown model at inference,
though it never trained to loop, raises accuracy on some reasoning primitives. This suite runs the
k-shot primitives (same questions as the `primitives` suite) with the model's layer order
[0, start), [start, start + b) r times, [start + b, depth): the block MIDAS copies, block ceil(n/2)
of the n = depth / b blocks (model/layer_order.py). The parameters are the checkpoint's, unchanged;
r = 1 is the plain model. b is the run's StackingConfig block size; a baseline run has no blocks of
its own, so it needs --loop_block_size (use the grown run's, to compare like with like).
"""

from __future__ import annotations

import time
from typing import Any, Dict, Mapping, Optional

from midas_jax.errors import require
from midas_jax.evals import figures, primitives
from midas_jax.evals.options import context_length, option
from midas_jax.model import layer_order


def block_size(model, options: Mapping[str, Any]) -> Optional[int]:
  explicit = options.get("loop_block_size")
  if explicit:
    return int(explicit)
  stacking = model.config.stacking
  if stacking.num_stages > 1:
    return stacking.resolved_block_size(model.config.model.num_layers)
  return None


def applies(model, options) -> Optional[str]:
  b = block_size(model, options)
  if b is None:
    return "the run did not grow, so it has no block size: pass --loop_block_size=B"
  if model.model_config.num_layers % b:
    return f"loop_block_size={b} does not divide the depth {model.model_config.num_layers}"
  return None


def run_suite(model, workdir: str, out_dir: str, options: Mapping[str, Any]) -> Dict[str, Any]:
  """`looping`: k-shot primitive accuracy with the middle block applied r = 1, 2, 3... times."""
  del workdir
  start = time.time()
  b = block_size(model, options)
  repeats = sorted({1, *(int(r) for r in option(options, "loop_repeats"))})
  require(all(r >= 1 for r in repeats), "--loop_repeats", f"every repeat count must be >= 1, got {repeats}",
          "write e.g. --loop_repeats=2,3")
  cfg = model.model_config
  by_repeat = {}
  for r in repeats:
    looped = layer_order.loop_middle_block(cfg, b, r) if r > 1 else cfg
    by_repeat[r] = primitives.evaluate_k_shot(model.params, looped, model.vocab, context_length(model), options)
  tasks = {name: {"primitive": by_repeat[1][name]["primitive"], "depth": by_repeat[1][name]["depth"],
                  "accuracy": {str(r): by_repeat[r][name]["accuracy"] for r in repeats},
                  "samples": {str(r): by_repeat[r][name]["samples"] for r in repeats}}
           for name in by_repeat[1]}
  figure = figures.line_chart(f"{out_dir}/looping.png",
                             {name: [by_repeat[r][name]["accuracy"] for r in repeats] for name in tasks}, repeats,
                             xlabel="applications r of the middle block", ylabel="accuracy",
                             title=f"{option(options, 'k_shot')}-shot accuracy with block "
                                   f"[{layer_order.middle_block(cfg.num_layers, b)}, "
                                   f"{layer_order.middle_block(cfg.num_layers, b) + b}) looped (step {model.step})")
  return {"block_size": b, "loop_start": layer_order.middle_block(cfg.num_layers, b), "repeats": repeats,
          "effective_depth": {str(r): cfg.num_layers + (r - 1) * b for r in repeats},
          "k_shot": option(options, "k_shot"), "num_examples": option(options, "num_examples"),
          "tasks": tasks, "figures": [figure], "eval_seconds": round(time.time() - start, 1)}
