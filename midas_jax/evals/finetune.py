"""Primitives after fine-tuning: a short fine-tune on N examples of one task, then held-out accuracy.

The MIDAS paper reports the primitives both k-shot and after fine-tuning. Here each task gets its own
fine-tune from the checkpoint's parameters: AdamW at a constant learning rate (no weight decay,
gradients clipped at norm 1) on rows `prompt + answer + newline`, the loss on the answer and the
newline only, so the model learns to answer and to stop, not to write questions: the trainer's
optimizer (optimizer.py) and train step (train/step.py) in a small loop. The training examples
come from their own random stream and never share a prompt with the held-out questions, which are
then answered zero-shot (the fine-tuned format) by greedy decoding.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from midas_jax import optimizer as optimizer_lib
from midas_jax.configs import ModelConfig, OptimizerConfig
from midas_jax.errors import require
from midas_jax.evals import decoding, figures, primitives, scoring
from midas_jax.evals.options import context_length, option
from midas_jax.model import Decoder
from midas_jax.padding import round_up
from midas_jax.train import step as step_lib
from midas_jax.train_state import TrainState

ROW_BUCKET = 64  # one row width (one compiled step) for every task of the default job
# AdamW at a constant rate (each fine-tune's own), no weight decay, gradients clipped at norm 1.
FINETUNE_OPTIMIZER = OptimizerConfig(warmup_steps=0, decay="constant", b1=0.9, b2=0.95, weight_decay=0.0,
                                     grad_clip_norm=1.0)


def training_rows(vocab, examples: Sequence[primitives.Question]) -> Dict[str, np.ndarray]:
  """One padded causal row per example: loss weights on the answer and its end of line only."""
  encoded = [(vocab.encode(e.prompt), vocab.encode(e.answer + "\n")) for e in examples]
  width = round_up(max(len(p) + len(a) - 1 for p, a in encoded), ROW_BUCKET)
  rows = {k: np.zeros((len(examples), width), np.int32) for k in ("inputs", "targets", "segment_ids")}
  weights = np.zeros((len(examples), width), np.float32)
  for i, (prompt, answer) in enumerate(encoded):
    ids = prompt + answer
    n = len(ids) - 1
    rows["inputs"][i, :n] = ids[:-1]
    rows["targets"][i, :n] = ids[1:]
    rows["segment_ids"][i, :n] = 1
    weights[i, len(prompt) - 1:n] = 1.0  # targets ids[len(prompt):], the answer and its newline
  rows["positions"] = np.broadcast_to(np.arange(width, dtype=np.int32), (len(examples), width)).copy()
  rows["prefix_mask"] = np.zeros((len(examples), width), np.bool_)
  rows["objective_ids"] = np.zeros((len(examples), width), np.int32)
  rows["loss_weights"] = weights
  return rows


@functools.lru_cache(maxsize=8)
def _optimizer_and_step(cfg: ModelConfig, learning_rate: float, steps: int):
  """The optimizer and the jitted train step, built once per (model, learning rate, steps), so the
  fine-tunes of every task share one compiled step."""
  opt = dataclasses.replace(FINETUNE_OPTIMIZER, learning_rate=learning_rate)
  schedule = optimizer_lib.learning_rate_schedule(opt, steps)
  tx = optimizer_lib.make_optimizer(opt, steps, schedule)
  return tx, jax.jit(step_lib.make_train_step(Decoder(cfg), tx, schedule, z_loss=0.0))


def finetune(params, cfg: ModelConfig, rows: Dict[str, np.ndarray], steps: int, batch_size: int,
             learning_rate: float, seed: int) -> Tuple[Any, List[float]]:
  """`steps` AdamW steps on batches drawn epoch by epoch from `rows`; returns (params, loss per step)."""
  tx, step = _optimizer_and_step(cfg, float(learning_rate), steps)
  params = jax.device_put(params)  # (jnp.asarray would compile a copy per leaf shape)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  count = len(rows["inputs"])
  batch_size = min(batch_size, count)
  rng = np.random.default_rng(seed)
  order, losses = np.array([], np.int64), []
  for _ in range(steps):
    if len(order) < batch_size:
      order = np.concatenate([order, rng.permutation(count)])
    take, order = order[:batch_size], order[batch_size:]
    state, metrics = step(state, {k: v[take] for k, v in rows.items()})
    losses.append(metrics["loss"])
  return state.params, [float(x) for x in jax.device_get(losses)]


def run_suite(model, workdir: str, out_dir: str, options: Mapping[str, Any]) -> Dict[str, Any]:
  """`primitives_finetune`: per task, fine-tune a copy of the checkpoint on N examples, then held-out accuracy."""
  del workdir
  n_train, steps = option(options, "finetune_examples"), option(options, "finetune_steps")
  require(n_train >= 1, "--finetune_examples", f"must be >= 1, got {n_train}", "256 is the default")
  require(steps >= 1, "--finetune_steps", f"must be >= 1, got {steps}", "100 is the default")
  num, seed = option(options, "num_examples"), option(options, "seed")
  start = time.time()
  held_out = {name: primitives.sample(name, num, seed) for name in primitives.task_names(options)}
  tasks = {}
  for name, questions in held_out.items():
    train = primitives.sample(name, n_train, seed, stream="finetune", exclude=[e.prompt for e in questions])
    tuned, losses = finetune(model.params, model.model_config, training_rows(model.vocab, train), steps,
                             option(options, "finetune_batch_size"), option(options, "finetune_learning_rate"), seed)
    completions = decoding.complete(tuned, model.model_config, model.vocab, [e.prompt for e in questions],
                                    [decoding.answer_budget(model.vocab, e) for e in questions],
                                    max_length=context_length(model), batch_size=option(options, "batch_size"))
    records = scoring.score(questions, completions)
    spec = primitives.TASKS[name]
    tail = losses[-10:]
    tasks[name] = dict(scoring.summarize(records), primitive=spec.primitive, depth=spec.depth,
                       train_examples=n_train, steps=steps, first_loss=losses[0],
                       final_loss=sum(tail) / len(tail), samples=records[:option(options, "samples")])
  figure = figures.bar_chart(f"{out_dir}/primitives_finetune.png", {n: t["accuracy"] for n, t in tasks.items()},
                            title=f"accuracy after fine-tuning on {n_train} examples, {steps} steps "
                                  f"(step {model.step})")
  return {"finetune_examples": n_train, "finetune_steps": steps, "num_examples": num, "seed": seed,
          "learning_rate": option(options, "finetune_learning_rate"), "tasks": tasks, "figures": [figure],
          "eval_seconds": round(time.time() - start, 1)}
