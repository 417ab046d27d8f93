"""Trains the anchor-function cells of an AnchorStudyConfig and draws the gamma x depth phase diagram.

One cell = one (arm, gamma, depth, seed): a fresh Decoder with ModelConfig(init="gamma") trained with
AdamW on the loss of the last token only, at `depth` throughout (arm "fixed") or grown to it from one
layer by MIDAS or GradStack, one layer per stage (the same gather along the `layers` axis as the
trainer's, stacking/grow.py). Its score, on test-split rows nobody trained on:
  inferential  fraction of held-out (4, 3) rows answered key-10 (the composite: reasoning)
  symmetric    fraction answered key-6 (the rule of the mirror pair (3, 4): memorizing)
  seen         accuracy on the 15 training pairs (did the model fit the task at all?)
Cells are written to WORKDIR/cells.jsonl as they finish, so an interrupted study resumes where it
stopped; a cell trained under different settings is never reused.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from midas_jax import fs
from midas_jax.configs import ModelConfig
from midas_jax.evals import figures
from midas_jax.model import Decoder
from midas_jax.optimizer import weight_decay_mask
from midas_jax.sharding import mirror_param_specs
from midas_jax.stacking import operators
from midas_jax.stacking.grow import grow_state
from midas_jax.stacking.schedule import prop_alpha_steps
from midas_jax.studies import anchor_task
from midas_jax.studies.anchor_config import AnchorStudyConfig
from midas_jax.train_state import TrainState

EVAL_SEED = 12345  # every cell is scored on the same rows
KINDS = ("inferential", "symmetric", "neither", "unfit")
FRACTIONS = ("inferential", "symmetric", "seen")


def model_config(cfg: AnchorStudyConfig, gamma: float, depth: int) -> ModelConfig:
  return ModelConfig(family=cfg.family, vocab_size=anchor_task.VOCAB_SIZE, d_model=cfg.d_model, num_layers=depth,
                     num_heads=cfg.num_heads, d_ff=cfg.d_ff, max_seq_len=anchor_task.SEQ_LEN, init="gamma",
                     init_gamma=float(gamma), dtype="float32")


def decoder_batch(tokens: jax.Array) -> Dict[str, jax.Array]:
  """The Decoder's batch format for plain causal rows (every token real, no bidirectional prefix)."""
  b, t = tokens.shape
  return {"inputs": tokens, "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
          "segment_ids": jnp.ones((b, t), jnp.int32), "prefix_mask": jnp.zeros((b, t), jnp.bool_)}


def last_token_logits(model: Decoder, params, tokens: jax.Array) -> jax.Array:
  """Logits at the last position, [b, 100]: the task's one answer token."""
  return model.apply({"params": params}, decoder_batch(tokens))[:, -1, :anchor_task.VOCAB_SIZE]


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

  held_out: anchor_task.AnchorExamples
  seen: anchor_task.AnchorExamples


def eval_sets(n: int, seed: int = EVAL_SEED) -> EvalSets:
  rng = np.random.default_rng(seed)
  return EvalSets(held_out=anchor_task.make_examples(rng, n, "test", (anchor_task.HELD_OUT,)),
                  seen=anchor_task.make_examples(rng, n * len(anchor_task.TRAIN_PAIRS), "test", anchor_task.TRAIN_PAIRS))


def score(predictions_held_out: np.ndarray, predictions_seen: np.ndarray, sets: EvalSets) -> Dict[str, float]:
  """The three fractions of a cell from its argmax answers."""
  keys = sets.held_out.keys
  return {"inferential": float(np.mean(predictions_held_out == anchor_task.composite(anchor_task.HELD_OUT, keys))),
          "symmetric": float(np.mean(predictions_held_out == anchor_task.symmetric_answer(keys))),
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


def stage_plan(cfg: AnchorStudyConfig, arm: str, depth: int) -> List[Tuple[int, int]]:
  """(depth, steps) of every stage of a cell: one stage for "fixed", else `depth` one-layer stages."""
  if arm == "fixed":
    return [(depth, cfg.steps)]
  steps = prop_alpha_steps(cfg.steps, depth, cfg.stage_alpha)
  return [(i + 1, t) for i, t in enumerate(steps)]


def _logical_state(model: Decoder, tx: optax.GradientTransformation, params) -> TrainState:
  """The logical axis names of (params, optimizer state): where growth finds each `layers` axis."""
  boxed = jax.eval_shape(model.init, jax.random.key(0), decoder_batch(jnp.zeros((1, anchor_task.SEQ_LEN), jnp.int32)))
  specs = nn.get_partition_spec(boxed["params"])
  opt_shapes = jax.eval_shape(tx.init, params)
  return TrainState(step=P(), params=specs, opt_state=mirror_param_specs(opt_shapes, params, specs))


def grow(model: Decoder, tx, params, opt_state, operator: str):
  """(params, opt_state) one layer deeper, grown by `operator` (copied layers keep their moments)."""
  depth = model.cfg.num_layers
  provenance = operators.provenance_for(operator, depth, 1)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
  grown = grow_state(state, _logical_state(model, tx, params), provenance, new_moments="copy")
  return grown.params, grown.opt_state


def train_cell(cfg: AnchorStudyConfig, gamma: float, depth: int, seed: int,
               sets: Optional[EvalSets] = None, arm: str = "fixed") -> dict:
  """Trains one cell; returns its final fractions, its kind and the fractions at every evaluation.

  A stacked arm evaluates at every `eval_every` steps and at the end of each stage (just before
  the growth), so its trajectory shows what each depth had learned.
  """
  start = time.time()
  sets = sets or eval_sets(cfg.eval_examples)
  rng = np.random.default_rng(seed)
  train = anchor_task.make_examples(rng, cfg.train_examples, "train")
  tokens, labels = jnp.asarray(train.tokens), jnp.asarray(train.labels)
  plan = stage_plan(cfg, arm, depth)
  model = Decoder(model_config(cfg, gamma, plan[0][0]))
  init_key, data_key = jax.random.split(jax.random.key(seed))
  params = nn.unbox(model.init(init_key, decoder_batch(tokens[:1]))["params"])
  tx = make_optimizer(cfg)
  opt_state = tx.init(params)
  every = cfg.eval_every or cfg.steps
  trajectory, done = [], 0
  for index, (stage_depth, stage_steps) in enumerate(plan):
    if index:
      params, opt_state = grow(model, tx, params, opt_state, arm)
      model = Decoder(model_config(cfg, gamma, stage_depth))
    run, predict = _stage_programs(model, tx, cfg.batch_size)
    end = done + stage_steps
    while done < end:
      n = min(every - done % every, end - done)
      params, opt_state, loss = run(params, opt_state, jnp.arange(done, done + n), tokens, labels, data_key)
      done += n
      if done % every == 0 or done == end:
        held = np.asarray(predict(params, jnp.asarray(sets.held_out.tokens)))
        seen = np.asarray(predict(params, jnp.asarray(sets.seen.tokens)))
        trajectory.append(dict(step=done, depth=stage_depth, loss=float(loss), **score(held, seen, sets)))
  final = {k: trajectory[-1][k] for k in ("inferential", "symmetric", "seen")}
  stacking = {} if arm == "fixed" else {"stage_alpha": cfg.stage_alpha, "stage_steps": [t for _, t in plan]}
  return dict(arm=arm, gamma=float(gamma), depth=int(depth), seed=int(seed), **final,
              kind=classify(final, cfg.fit_threshold), final_loss=trajectory[-1]["loss"],
              seconds=round(time.time() - start, 1), **stacking, trajectory=trajectory)


def _stage_programs(model: Decoder, tx, batch_size: int):
  """The jitted training scan and argmax prediction of one stage's model."""

  def loss_fn(p, rows, targets):
    logits = last_token_logits(model, p, rows)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @jax.jit
  def run(p, o, steps, rows, targets, key):
    """len(steps) optimizer steps in one scan; the data are arguments, not constants baked into the program."""
    def one_step(carry, step):
      p, o = carry
      idx = jax.random.randint(jax.random.fold_in(key, step), (batch_size,), 0, rows.shape[0])
      loss, grads = jax.value_and_grad(loss_fn)(p, rows[idx], targets[idx])
      updates, o = tx.update(grads, o, p)
      return (optax.apply_updates(p, updates), o), loss

    (p, o), losses = jax.lax.scan(one_step, (p, o), steps)
    return p, o, losses.mean()

  @jax.jit
  def predict(p, rows):
    return jnp.argmax(last_token_logits(model, p, rows), axis=-1)

  return run, predict


def _training_settings(cfg: AnchorStudyConfig) -> dict:
  """The settings a cell's result depends on besides its (arm, gamma, depth, seed): resume only if equal."""
  d = dataclasses.asdict(cfg)
  for grid in ("gammas", "depths", "seeds", "arms", "fit_threshold", "stage_alpha"):
    d.pop(grid)  # stage_alpha: only stacked cells read it, and they record it (_read_cells)
  return d


def _key(cell: dict) -> tuple:
  return (cell.get("arm", "fixed"), float(cell["gamma"]), int(cell["depth"]), int(cell["seed"]))


def _read_cells(path: str, settings: dict, stage_alpha: float) -> Dict[tuple, dict]:
  """The finished cells trained under `settings` (stacked ones also under `stage_alpha`)."""
  cells = {}
  if fs.isfile(path):
    for line in fs.read_text(path).splitlines():
      if line.strip():
        row = json.loads(line)
        stacked = row.get("arm", "fixed") != "fixed"
        if row.get("settings") == settings and (not stacked or row.get("stage_alpha") == stage_alpha):
          cells[_key(row)] = row
  return cells


def rows_of(cfg: AnchorStudyConfig) -> List[Tuple[str, int]]:
  """The phase diagram's rows: (arm, depth), arms in config order."""
  return [(arm, depth) for arm in cfg.arms for depth in cfg.depths]


def summarize(cfg: AnchorStudyConfig, cells: Sequence[dict]) -> List[dict]:
  """Per (arm, gamma, depth): the fractions averaged over seeds, their range over seeds, the seeds'
  kinds, and the kind of the mean."""
  out = []
  for arm, depth in rows_of(cfg):
    for gamma in cfg.gammas:
      rows = [c for c in cells if _key(c)[:3] == (arm, float(gamma), depth)]
      if not rows:
        continue
      mean = {k: float(np.mean([r[k] for r in rows])) for k in FRACTIONS}
      spread = {k: [float(min(r[k] for r in rows)), float(max(r[k] for r in rows))] for k in FRACTIONS}
      out.append(dict(arm=arm, gamma=float(gamma), depth=depth, **mean, seed_range=spread,
                      kind=classify(mean, cfg.fit_threshold), seed_kinds=[r["kind"] for r in rows]))
  return out


def run_study(cfg: AnchorStudyConfig, workdir: str, log: Callable[[str], None] = print) -> dict:
  """Trains every missing cell (resuming from cells.jsonl), then writes anchor_study.json and the PNG."""
  fs.makedirs(workdir)
  settings = _training_settings(cfg)
  cells_path = fs.join(workdir, "cells.jsonl")
  done = _read_cells(cells_path, settings, cfg.stage_alpha)
  sets = eval_sets(cfg.eval_examples)
  keys = [(arm, float(g), d, s) for arm, d in rows_of(cfg) for g in cfg.gammas for s in cfg.seeds]
  for key in keys:
    if key in done:
      continue
    arm, gamma, depth, seed = key
    cell = train_cell(cfg, gamma, depth, seed, sets, arm=arm)
    done[key] = cell
    fs.append_text(cells_path, json.dumps(dict(cell, settings=settings)) + "\n")
    log(f"{arm:<9} gamma={gamma:<5} depth={depth} seed={seed}: inferential {cell['inferential']:.2f} "
        f"symmetric {cell['symmetric']:.2f} seen {cell['seen']:.2f} -> {cell['kind']} ({cell['seconds']}s)")
  cells = [done[k] for k in keys]
  result = {"config": dataclasses.asdict(cfg), "grid": summarize(cfg, cells),
            "cells": [{k: v for k, v in c.items() if k != "settings"} for c in cells]}
  result["phase_diagram"] = fs.join(workdir, "phase_diagram.png")
  plot_phase_diagram(cfg, result["grid"], result["phase_diagram"])
  fs.write_json(fs.join(workdir, "anchor_study.json"), result)
  return result


def format_grid(cfg: AnchorStudyConfig, grid: Sequence[dict]) -> str:
  """A text phase diagram: one row per (arm, depth), one column per gamma, each cell 'I/S seen kind'
  (seed means), then one line per cell with each seed's fractions."""
  by = {(g["arm"], g["gamma"], g["depth"]): g for g in grid}
  lines = ["arm       depth \\ gamma " + "".join(f"{g:>22}" for g in cfg.gammas)]
  for arm, depth in rows_of(cfg):
    row = f"{arm:<9} {depth:>13} "
    for gamma in cfg.gammas:
      g = by.get((arm, float(gamma), depth))
      row += f"{'-':>22}" if g is None else (
          f"{g['inferential']:.2f}/{g['symmetric']:.2f} {g['seen']:.2f} {g['kind'][:5]:>5}".rjust(22))
    lines.append(row)
  lines.append("cells: inferential (key-10) / symmetric (key-6) fraction on the held-out pair (4,3), "
               f"seen-pair test accuracy, kind; means over {len(cfg.seeds)} seed(s)")
  if len(cfg.seeds) > 1:
    for g in grid:
      r = g["seed_range"]
      lines.append(f"  {g['arm']} depth {g['depth']} gamma {g['gamma']:g}: inferential {r['inferential'][0]:.2f}-"
                   f"{r['inferential'][1]:.2f}, symmetric {r['symmetric'][0]:.2f}-{r['symmetric'][1]:.2f}, "
                   f"seen {r['seen'][0]:.2f}-{r['seen'][1]:.2f} over seeds; kinds {', '.join(g['seed_kinds'])}")
  return "\n".join(lines)


def plot_phase_diagram(cfg: AnchorStudyConfig, grid: Sequence[dict], path: str) -> None:
  """Three heatmaps over gamma x (arm, depth): inferential fraction, symmetric fraction, seen-pair
  accuracy (seed means). Cells whose seen-pair accuracy is below fit_threshold (the task was not
  fitted) are hatched."""
  plt = figures.pyplot()
  gammas, rows = list(cfg.gammas), rows_of(cfg)
  by = {(g["arm"], g["gamma"], g["depth"]): g for g in grid}
  panels = (("inferential", "held-out (4,3) answered key-10 (inferential)", "Greens"),
            ("symmetric", "held-out (4,3) answered key-6 (symmetric)", "Reds"),
            ("seen", "seen-pair test accuracy", "Blues"))
  fig, axes = plt.subplots(1, 3, figsize=(4.2 * 3, 0.6 * len(rows) + 2.2), squeeze=False)
  for ax, (key, title, cmap) in zip(axes[0], panels):
    values = np.full((len(rows), len(gammas)), np.nan)
    for i, (arm, d) in enumerate(rows):
      for j, g in enumerate(gammas):
        cell = by.get((arm, float(g), d))
        if cell is None:
          continue
        values[i, j] = cell[key]
        ax.text(j, i, f"{cell[key]:.2f}\n{cell['kind']}", ha="center", va="center", fontsize=8,
                color="w" if cell[key] > 0.6 else "k")
        if cell["kind"] == "unfit":
          ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", lw=0, alpha=0.5))
    ax.imshow(values, cmap=cmap, vmin=0, vmax=1, origin="lower", aspect="auto")
    ax.set_xticks(range(len(gammas)), [f"{g:g}" for g in gammas])
    ax.set_yticks(range(len(rows)), [f"{arm} {d}" for arm, d in rows])
    ax.set_xlabel("gamma (larger = smaller init)", fontsize=9)
    ax.set_ylabel("arm, depth (layers)")
    ax.set_title(title, fontsize=9)
  fig.suptitle(f"anchor-function study ({cfg.family}, d_model {cfg.d_model}, {cfg.steps} steps, "
               f"{len(cfg.seeds)} seed(s); init std = d_in ** -gamma; hatched: seen accuracy < {cfg.fit_threshold:g})",
               fontsize=10)
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=110)
  plt.close(fig)
