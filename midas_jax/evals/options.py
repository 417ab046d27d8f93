"""The options every evaluation suite reads (`midas eval` flags set them), with their defaults."""

from __future__ import annotations

from typing import Any, Dict, Mapping

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
