"""Trains the anchor-function cells of an AnchorStudyConfig and draws the gamma x depth phase diagram.

One cell = one (gamma, depth, seed): a fresh Decoder with ModelConfig(init="gamma") trained with
AdamW on the loss of the last token only. Its score, on test-split rows nobody trained on:
  inferential  fraction of held-out (4, 3) rows answered key-10 (the composite: reasoning)
  symmetric    fraction answered key-6 (the rule of the mirror pair (3, 4): memorizing)
  seen         accuracy on the 15 training pairs (did the model fit the task at all?)
Cells are appended to WORKDIR/cells.jsonl as they finish, so an interrupted study resumes where it
stopped; a cell trained under different settings is never reused.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable, Dict, List, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from midas_jax import fs
from midas_jax.configs import ModelConfig
from midas_jax.evals import anchor
from midas_jax.evals.anchor import AnchorStudyConfig
from midas_jax.model import Decoder
from midas_jax.train.optimizer import weight_decay_mask

EVAL_SEED = 12345  # every cell is scored on the same rows
KINDS = ("inferential", "symmetric", "neither", "unfit")


def model_config(cfg: AnchorStudyConfig, gamma: float, depth: int) -> ModelConfig:
  return ModelConfig(family=cfg.family, vocab_size=anchor.VOCAB_SIZE, d_model=cfg.d_model, num_layers=depth,
                     num_heads=cfg.num_heads, d_ff=cfg.d_ff, max_seq_len=anchor.SEQ_LEN, init="gamma",
                     init_gamma=float(gamma), dtype="float32")


def decoder_batch(tokens: jax.Array) -> Dict[str, jax.Array]:
  """The Decoder's batch format for plain causal rows (every token real, no bidirectional prefix)."""
  b, t = tokens.shape
  return {"inputs": tokens, "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
          "segment_ids": jnp.ones((b, t), jnp.int32), "prefix_mask": jnp.zeros((b, t), jnp.bool_)}


def last_token_logits(model: Decoder, params, tokens: jax.Array) -> jax.Array:
  """Logits at the last position, [b, 100]: the task's one answer token."""
  return model.apply({"params": params}, decoder_batch(tokens))[:, -1, :anchor.VOCAB_SIZE]


def make_optimizer(cfg: AnchorStudyConfig) -> optax.GradientTransformation:
  """AdamW (embeddings decayed too, as in the paper's PyTorch setup) after clipping, warmup + cosine."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), cfg.steps, cfg.learning_rate * cfg.final_lr_fraction)
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm),
                     optax.adamw(schedule, weight_decay=cfg.weight_decay,
                                 mask=lambda p: weight_decay_mask(p, decay_embeddings=True)))


@dataclasses.dataclass(frozen=True)
class EvalSets:
  """Test-split rows: the held-out pair, and the 15 training pairs (seen pairs, unseen keys/positions)."""

  held_out: anchor.AnchorExamples
  seen: anchor.AnchorExamples


def eval_sets(n: int, seed: int = EVAL_SEED) -> EvalSets:
  rng = np.random.default_rng(seed)
  return EvalSets(held_out=anchor.make_examples(rng, n, "test", (anchor.HELD_OUT,)),
                  seen=anchor.make_examples(rng, n * len(anchor.TRAIN_PAIRS), "test", anchor.TRAIN_PAIRS))


def score(predictions_held_out: np.ndarray, predictions_seen: np.ndarray, sets: EvalSets) -> Dict[str, float]:
  """The three fractions of a cell from its argmax answers."""
  keys = sets.held_out.keys
  return {"inferential": float(np.mean(predictions_held_out == anchor.composite(anchor.HELD_OUT, keys))),
          "symmetric": float(np.mean(predictions_held_out == anchor.symmetric_answer(keys))),
          "seen": float(np.mean(predictions_seen == sets.seen.labels))}


def classify(fractions: Dict[str, float], fit_threshold: float) -> str:
  """unfit (seen pairs below the threshold), else the solution most held-out rows follow (if > half)."""
  if fractions["seen"] < fit_threshold:
    return "unfit"
  if fractions["inferential"] > 0.5:
    return "inferential"
  if fractions["symmetric"] > 0.5:
    return "symmetric"
  return "neither"


def train_cell(cfg: AnchorStudyConfig, gamma: float, depth: int, seed: int,
               sets: Optional[EvalSets] = None) -> dict:
  """Trains one cell; returns its final fractions, its kind and the fractions at every evaluation."""
  start = time.time()
  sets = sets or eval_sets(cfg.eval_examples)
  rng = np.random.default_rng(seed)
  train = anchor.make_examples(rng, cfg.train_examples, "train")
  tokens, labels = jnp.asarray(train.tokens), jnp.asarray(train.labels)
  model = Decoder(model_config(cfg, gamma, depth))
  init_key, data_key = jax.random.split(jax.random.key(seed))
  params = nn.unbox(model.init(init_key, decoder_batch(tokens[:1]))["params"])
  tx = make_optimizer(cfg)
  opt_state = tx.init(params)

  def loss_fn(p, rows, targets):
    logits = last_token_logits(model, p, rows)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @jax.jit
  def run(p, o, steps, rows, targets, key):
    """len(steps) optimizer steps in one scan; the data are arguments, not constants baked into the program."""
    def one_step(carry, step):
      p, o = carry
      idx = jax.random.randint(jax.random.fold_in(key, step), (cfg.batch_size,), 0, rows.shape[0])
      loss, grads = jax.value_and_grad(loss_fn)(p, rows[idx], targets[idx])
      updates, o = tx.update(grads, o, p)
      return (optax.apply_updates(p, updates), o), loss

    (p, o), losses = jax.lax.scan(one_step, (p, o), steps)
    return p, o, losses.mean()

  @jax.jit
  def predict(p, rows):
    return jnp.argmax(last_token_logits(model, p, rows), axis=-1)

  def evaluate(p) -> Dict[str, float]:
    held = np.asarray(predict(p, jnp.asarray(sets.held_out.tokens)))
    seen = np.asarray(predict(p, jnp.asarray(sets.seen.tokens)))
    return score(held, seen, sets)

  every = cfg.eval_every or cfg.steps
  trajectory = []
  done = 0
  while done < cfg.steps:
    n = min(every, cfg.steps - done)
    params, opt_state, loss = run(params, opt_state, jnp.arange(done, done + n), tokens, labels, data_key)
    done += n
    trajectory.append(dict(step=done, loss=float(loss), **evaluate(params)))
  final = {k: trajectory[-1][k] for k in ("inferential", "symmetric", "seen")}
  return dict(gamma=float(gamma), depth=int(depth), seed=int(seed), **final,
              kind=classify(final, cfg.fit_threshold), final_loss=trajectory[-1]["loss"],
              seconds=round(time.time() - start, 1), trajectory=trajectory)


def _training_settings(cfg: AnchorStudyConfig) -> dict:
  """The settings a cell's result depends on besides its (gamma, depth, seed): resume only if equal."""
  d = dataclasses.asdict(cfg)
  for grid in ("gammas", "depths", "seeds", "fit_threshold"):
    d.pop(grid)
  return d


def _read_cells(path: str, settings: dict) -> Dict[tuple, dict]:
  cells = {}
  if fs.isfile(path):
    for line in fs.read_text(path).splitlines():
      if line.strip():
        row = json.loads(line)
        if row.get("settings") == settings:
          cells[(row["gamma"], row["depth"], row["seed"])] = row
  return cells


def summarize(cfg: AnchorStudyConfig, cells: Sequence[dict]) -> List[dict]:
  """Per (gamma, depth): the fractions averaged over seeds, the seeds' kinds, and the cell's kind."""
  out = []
  for depth in cfg.depths:
    for gamma in cfg.gammas:
      rows = [c for c in cells if c["gamma"] == float(gamma) and c["depth"] == depth]
      if not rows:
        continue
      mean = {k: float(np.mean([r[k] for r in rows])) for k in ("inferential", "symmetric", "seen")}
      out.append(dict(gamma=float(gamma), depth=depth, **mean, kind=classify(mean, cfg.fit_threshold),
                      seed_kinds=[r["kind"] for r in rows]))
  return out


def run_study(cfg: AnchorStudyConfig, workdir: str, log: Callable[[str], None] = print) -> dict:
  """Trains every missing cell (resuming from cells.jsonl), then writes anchor_study.json and the PNG."""
  fs.makedirs(workdir)
  settings = _training_settings(cfg)
  cells_path = fs.join(workdir, "cells.jsonl")
  done = _read_cells(cells_path, settings)
  sets = eval_sets(cfg.eval_examples)
  for depth in cfg.depths:
    for gamma in cfg.gammas:
      for seed in cfg.seeds:
        key = (float(gamma), depth, seed)
        if key in done:
          continue
        cell = train_cell(cfg, gamma, depth, seed, sets)
        done[key] = cell
        fs.append_text(cells_path, json.dumps(dict(cell, settings=settings)) + "\n")
        log(f"gamma={gamma:<5} depth={depth} seed={seed}: inferential {cell['inferential']:.2f} "
            f"symmetric {cell['symmetric']:.2f} seen {cell['seen']:.2f} -> {cell['kind']} ({cell['seconds']}s)")
  cells = [done[(float(g), d, s)] for d in cfg.depths for g in cfg.gammas for s in cfg.seeds]
  result = {"config": dataclasses.asdict(cfg), "grid": summarize(cfg, cells),
            "cells": [{k: v for k, v in c.items() if k != "settings"} for c in cells]}
  result["phase_diagram"] = fs.join(workdir, "phase_diagram.png")
  plot_phase_diagram(cfg, result["grid"], result["phase_diagram"])
  fs.write_json(fs.join(workdir, "anchor_study.json"), result)
  return result


def format_grid(cfg: AnchorStudyConfig, grid: Sequence[dict]) -> str:
  """A text phase diagram: one row per depth, one column per gamma, each cell 'I/S seen kind'."""
  by = {(g["gamma"], g["depth"]): g for g in grid}
  lines = ["depth \\ gamma " + "".join(f"{g:>22}" for g in cfg.gammas)]
  for depth in cfg.depths:
    row = f"{depth:>13} "
    for gamma in cfg.gammas:
      g = by.get((float(gamma), depth))
      row += f"{'-':>22}" if g is None else (
          f"{g['inferential']:.2f}/{g['symmetric']:.2f} {g['seen']:.2f} {g['kind'][:5]:>5}".rjust(22))
    lines.append(row)
  lines.append("cells: inferential (key-10) / symmetric (key-6) fraction on the held-out pair (4,3), "
               "seen-pair test accuracy, kind")
  return "\n".join(lines)


def plot_phase_diagram(cfg: AnchorStudyConfig, grid: Sequence[dict], path: str) -> None:
  """Three heatmaps over gamma x depth: inferential fraction, symmetric fraction, seen-pair accuracy.

  Cells whose seen-pair accuracy is below fit_threshold (the task was not fitted) are hatched.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  gammas, depths = list(cfg.gammas), list(cfg.depths)
  by = {(g["gamma"], g["depth"]): g for g in grid}
  panels = (("inferential", "held-out (4,3) answered key-10 (inferential)", "Greens"),
            ("symmetric", "held-out (4,3) answered key-6 (symmetric)", "Reds"),
            ("seen", "seen-pair test accuracy", "Blues"))
  fig, axes = plt.subplots(1, 3, figsize=(4.2 * 3, 0.6 * len(depths) + 2.2), squeeze=False)
  for ax, (key, title, cmap) in zip(axes[0], panels):
    values = np.full((len(depths), len(gammas)), np.nan)
    for i, d in enumerate(depths):
      for j, g in enumerate(gammas):
        cell = by.get((float(g), d))
        if cell is not None:
          values[i, j] = cell[key]
    ax.imshow(values, cmap=cmap, vmin=0, vmax=1, origin="lower", aspect="auto")
    for i, d in enumerate(depths):
      for j, g in enumerate(gammas):
        cell = by.get((float(g), d))
        if cell is None:
          continue
        ax.text(j, i, f"{cell[key]:.2f}\n{cell['kind']}", ha="center", va="center", fontsize=8,
                color="w" if cell[key] > 0.6 else "k")
        if cell["kind"] == "unfit":
          ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", lw=0, alpha=0.5))
    ax.set_xticks(range(len(gammas)), [f"{g:g}" for g in gammas])
    ax.set_yticks(range(len(depths)), [str(d) for d in depths])
    ax.set_xlabel("gamma (std = d_in ** -gamma; larger = smaller init)")
    ax.set_ylabel("depth (layers)")
    ax.set_title(title, fontsize=9)
  fig.suptitle(f"anchor-function study ({cfg.family}, d_model {cfg.d_model}, {cfg.steps} steps, "
               f"{len(cfg.seeds)} seed(s); hatched: seen accuracy < {cfg.fit_threshold:g})", fontsize=10)
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=110)
  plt.close(fig)
