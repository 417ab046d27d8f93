"""The registry of evaluation suites, their shared options, and the runner that writes DIR/eval/<suite>.json.

A suite is `run_suite(model, workdir, out_dir, options) -> dict`: `model` is a LoadedModel
(midas_jax.checkpoint.load_model), `out_dir` is DIR/eval/ (PNG figures go there), the returned dict
must be JSON-serializable. A suite module may also define `applies(model, options) -> str | None`,
the reason it does not apply to that model (None when it does); `--suite=all` skips those, naming
the reason, and asking for one by name turns the reason into an error. Modules are imported only
when their suite runs, so the CLI stays light.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Dict, List, Mapping, Optional

from midas_jax import fs
from midas_jax.errors import ConfigError

SUITES: Dict[str, str] = {
    "primitives": "midas_jax.evals.primitives:run_suite",
    "primitive_scores": "midas_jax.evals.likelihood:run_suite",
    "primitives_finetune": "midas_jax.evals.finetune:run_suite",
    "memorization": "midas_jax.evals.memorization:run_suite",
    "looping": "midas_jax.evals.looping:run_suite",
    "similarity": "midas_jax.evals.similarity:run_suite",
    "embeddings": "midas_jax.evals.embeddings:run_suite",
    "delta_l": "midas_jax.evals.delta_l:run_suite",
}

# Every option a suite reads, with its default (the CLI flags of `midas eval` set them).
DEFAULTS: Dict[str, Any] = {
    "k_shot": 5,                 # solved examples before each primitive question
    "num_examples": 100,         # held-out questions per primitive task (and memorization questions)
    "score_examples": 500,       # primitive_scores: held-out questions per task (teacher-forced, cheap)
    "seed": 0,                   # the examples are a pure function of (task, seed, index)
    "tasks": None,               # primitive tasks to run (None: all of primitives.TASKS)
    "batch_size": 32,            # decoding rows per forward pass
    "samples": 3,                # predictions kept per task in the JSON, for reading
    "loop_repeats": (2, 3),      # looping: applications of the middle block (1 is always added)
    "loop_block_size": None,     # looping: layers per block (None: the run's StackingConfig block size)
    "finetune_examples": 256,    # primitives_finetune: training examples per task
    "finetune_steps": 100,       # primitives_finetune: optimizer steps per task
    "finetune_batch_size": 16,
    "finetune_learning_rate": 1e-3,
}


def option(options: Mapping[str, Any], name: str) -> Any:
  value = options.get(name)
  return DEFAULTS[name] if value is None else value


def effective_options(options: Mapping[str, Any]) -> Dict[str, Any]:
  """The defaults overridden by what was given: what a result was computed with."""
  merged = dict(DEFAULTS)
  merged.update({k: v for k, v in options.items() if v is not None})
  return {k: merged[k] for k in sorted(merged)}


def context_length(model) -> int:
  """Prompt + answer tokens a model is evaluated with: the length it was trained on."""
  return min(model.config.data.seq_len, model.model_config.max_seq_len)


def _split(target: str):
  module_name, _, fn_name = target.partition(":")
  return module_name, fn_name


def load_suite(name: str):
  """The suite's module (for `applies`) and run function; ConfigError if unknown or not installed."""
  if name not in SUITES:
    raise ConfigError("--suite", f"unknown suite {name!r}", f"use one of {tuple(SUITES) + ('all',)}")
  module_name, fn_name = _split(SUITES[name])
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name != module_name:
      raise
    raise ConfigError("--suite", f"suite {name!r} is registered but its module {module_name} is not there",
                      "pick another suite, or update midas_jax") from None
  return module, getattr(module, fn_name)


def skip_reason(name: str, model, options: Mapping[str, Any]) -> Optional[str]:
  """Why suite `name` does not apply to `model` (or is missing), or None."""
  try:
    module, _ = load_suite(name)
  except ConfigError as e:
    return e.problem
  applies = getattr(module, "applies", None)
  return applies(model, options) if applies else None


def resolve(suite: str) -> List[str]:
  """Names to run for --suite (a name, a comma-separated list or "all"); checks them."""
  names = list(SUITES) if suite == "all" else [s.strip() for s in suite.split(",") if s.strip()]
  for name in names:
    if name not in SUITES:
      raise ConfigError("--suite", f"unknown suite {name!r}", f"use one of {tuple(SUITES) + ('all',)}")
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
  _, fn = load_suite(name)
  start = time.time()
  results = fn(model, workdir, out_dir, options)
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
