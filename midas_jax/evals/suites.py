"""The registry of evaluation suites and the runner that writes DIR/eval/<suite>.json.

A suite is a module with `run_suite(model, workdir, out_dir, options) -> dict`: `model` is a
LoadedModel (midas_jax.checkpoint.load_model), `out_dir` is DIR/eval/ (PNG figures go there), the
returned dict must be JSON-serializable; its options and their defaults are evals/options.py's. A
suite module may also define `applies(model, options) -> str | None`, the reason it does not apply
to that model (None when it does); `--suite=all` skips those, naming the reason, and asking for one
by name turns the reason into an error.

A suite whose module sets RUNS_ALONE (lm_eval: lm-evaluation-harness tasks, with flags and a results
JSON of their own, lm_eval_adapter.evaluate) is asked for by itself, runs through its own command
path in `midas eval`, and is left out of `--suite=all`.
"""

from __future__ import annotations

import dataclasses
import time
from types import ModuleType
from typing import Any, Dict, List, Mapping, Optional

from midas_jax import fs
from midas_jax.errors import ConfigError
from midas_jax.evals import (delta_l, embeddings, finetune, lm_eval_adapter, looping, memorization,
                             primitive_scores, primitives, similarity)
from midas_jax.evals.options import effective_options
from midas_jax.model import dot_support

SUITES: Dict[str, ModuleType] = {
    "primitives": primitives,
    "primitive_scores": primitive_scores,
    "primitives_finetune": finetune,
    "memorization": memorization,
    "looping": looping,
    "similarity": similarity,
    "embeddings": embeddings,
    "delta_l": delta_l,
    "lm_eval": lm_eval_adapter,
}


def _known(name: str) -> ModuleType:
  if name not in SUITES:
    raise ConfigError("--suite", f"unknown suite {name!r}", f"use one of {tuple(SUITES) + ('all',)}")
  return SUITES[name]


def runs_alone(name: str) -> bool:
  """Whether suite `name` runs by itself, through its own command path (see the module's docstring)."""
  return bool(getattr(SUITES.get(name), "RUNS_ALONE", False))


def skip_reason(name: str, model, options: Mapping[str, Any]) -> Optional[str]:
  """Why suite `name` does not apply to `model`, or None."""
  applies = getattr(_known(name), "applies", None)
  return applies(model, options) if applies else None


def resolve(suite: str) -> List[str]:
  """Names to run for --suite (a name, a comma-separated list or "all"); checks them."""
  if suite == "all":
    names = [n for n in SUITES if not runs_alone(n)]
  else:
    names = [s.strip() for s in suite.split(",") if s.strip()]
  for name in names:
    _known(name)
  if not names:
    raise ConfigError("--suite", "no suite given", f"use one of {tuple(SUITES) + ('all',)}")
  return names


def _jsonable(value):
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  return value


def run(name: str, model, workdir: str, options: Mapping[str, Any], out_dir: Optional[str] = None) -> Dict[str, Any]:
  """Runs one suite and writes <out_dir>/<name>.json with the checkpoint's step, stage and depth."""
  out_dir = out_dir or fs.join(workdir, "eval")
  fs.makedirs(out_dir)
  reason = skip_reason(name, model, options)
  if reason:
    raise ConfigError("--suite", f"suite {name!r} does not apply to this checkpoint: {reason}",
                      "pick another suite, or pass the option it names")
  start = time.time()
  # A CPU that cannot run the model's bfloat16 matmuls in some program of the suite: again with
  # float32 operands (model/dot_support.py); the suite's inputs are only read, so a retry is safe.
  results = dot_support.retry_widened(
      lambda cfg: SUITES[name].run_suite(dataclasses.replace(model, model_config=cfg), workdir, out_dir, options),
      model.model_config)
  record = {"suite": name, "step": model.step, "stage": model.stage, "depth": model.model_config.num_layers,
            "options": effective_options(options), "seconds": round(time.time() - start, 1),
            "results": results}
  record = _jsonable(record)
  fs.write_json(fs.join(out_dir, f"{name}.json"), record)
  return record


def run_many(names: List[str], model, workdir: str, options: Mapping[str, Any], out_dir: Optional[str] = None,
             skip_inapplicable: bool = False) -> Dict[str, Dict[str, Any]]:
  """Runs suites in order; with skip_inapplicable, those that do not apply are recorded as skipped."""
  done: Dict[str, Dict[str, Any]] = {}
  for name in names:
    reason = skip_reason(name, model, options) if skip_inapplicable else None
    done[name] = {"skipped": reason} if reason else run(name, model, workdir, options, out_dir)
  return done
