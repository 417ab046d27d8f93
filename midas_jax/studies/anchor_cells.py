"""One cell of the anchor-function study: a model trained on the task and scored on unseen rows.

One cell = one (arm, gamma, learning rate, depth, seed): a fresh Decoder with ModelConfig(init="gamma")
trained by the study's optimizer at that peak rate on the loss of the last token only, at `depth`
throughout (arm "fixed"), grown to it from one layer, one layer per stage, by MIDAS, GradStack or
fresh_block (fresh_block's new layer is drawn at the cell's gamma init), or as a weight-tied looped
model of `depth` layer applications (arm_model). It trains as the trainer does, in a small loop: the
trainer's optimizer (optimizer.py), train step (train/step.py, the loss weighted onto the last token)
and growth of the TrainState (stacking/grow.py); only the data (rows drawn from a fixed set inside one
lax.scan) and the scoring are the study's own. Its score, on test-split rows nobody trained on:
  inferential  fraction of held-out (4, 3) rows answered key-10 (the composite: reasoning)
  symmetric    fraction answered key-6 (the rule of the mirror pair (3, 4): memorizing)
  seen         accuracy on the 15 training pairs (did the model fit the task at all?)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Dict, List, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from midas_jax import flops
from midas_jax import optimizer as optimizer_lib
from midas_jax.configs import ModelConfig
from midas_jax.model import Decoder
from midas_jax.stacking import operators
from midas_jax.stacking.grow import grow_state
from midas_jax.stacking.schedule import prop_alpha_steps
from midas_jax.studies import anchor_task
from midas_jax.studies.anchor_config import GROWN, AnchorStudyConfig
from midas_jax.train import step as step_lib
from midas_jax.train_state import TrainState, abstract_state

EVAL_SEED = 12345  # every cell is scored on the same rows
KINDS = ("inferential", "symmetric", "neither", "unfit")
FRACTIONS = ("inferential", "symmetric", "seen")


def model_config(cfg: AnchorStudyConfig, gamma: float, depth: int) -> ModelConfig:
  return cfg.cell_model(gamma, depth, anchor_task.VOCAB_SIZE, anchor_task.SEQ_LEN)


def arm_model(cfg: AnchorStudyConfig, arm: str, gamma: float, depth: int) -> ModelConfig:
  """The model an arm trains at (stage) depth `depth`: `depth` distinct layers, except the looped arm.

  The looped arm stores cfg.loop_block layers (1 by default) and applies them depth / loop_block times
  in a row, all tied (ModelConfig.loop_*; its gradient is the sum over the applications), so every
  step costs what the grown arms' final `depth`-layer model costs, while its parameters are one
  block's. Why one layer tied `depth` times: the grown arms grow one-layer blocks from a one-layer
  model, so at the end every layer of a MIDAS or GradStack model descends from that one layer (its
  lineage); the looped model is the same function class with the copies never allowed to drift apart,
  the paper's "stacking is like looping" taken literally. Matching the final depth's compute (not the
  grown arms' summed compute, about 3/4 of it under Prop-1 at depth 4) keeps the looped model's
  forward pass as deep as the grown model's, which is what the likeness is about.
  """
  if arm != "looped":
    return model_config(cfg, gamma, depth)
  return dataclasses.replace(model_config(cfg, gamma, cfg.loop_block), loop_start=0, loop_size=cfg.loop_block,
                             loop_repeats=depth // cfg.loop_block)


def train_flops_per_step(cfg: AnchorStudyConfig, model_cfg: ModelConfig) -> float:
  """Model FLOPs of one optimizer step of `model_cfg` (flops.py's count, every position of the batch:
  the loss reads the last token, but the forward and backward run over all of them)."""
  return cfg.batch_size * anchor_task.SEQ_LEN * flops.train_flops_per_token(model_cfg, anchor_task.SEQ_LEN)


def decoder_batch(tokens: jax.Array) -> Dict[str, jax.Array]:
  """The Decoder's batch format for plain causal rows (every token real, no bidirectional prefix)."""
  b, t = tokens.shape
  return {"inputs": tokens, "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
          "segment_ids": jnp.ones((b, t), jnp.int32), "prefix_mask": jnp.zeros((b, t), jnp.bool_)}


def last_token_batch(tokens: jax.Array, labels: jax.Array) -> Dict[str, jax.Array]:
  """decoder_batch with the train step's loss on the last token alone: target `labels`, weight 1 there, 0
  elsewhere (the weighted mean over the batch is then the mean of the answers' cross-entropies)."""
  b, t = tokens.shape
  last = jnp.broadcast_to(jnp.arange(t) == t - 1, (b, t))
  return dict(decoder_batch(tokens), targets=jnp.where(last, labels[:, None], 0).astype(jnp.int32),
              loss_weights=last.astype(jnp.float32), objective_ids=jnp.zeros((b, t), jnp.int32))


def last_token_logits(model: Decoder, params, tokens: jax.Array) -> jax.Array:
  """Logits at the last position, [b, 100]: the task's one answer token."""
  return model.apply({"params": params}, decoder_batch(tokens))[:, -1, :anchor_task.VOCAB_SIZE]


def cell_optimizer(cfg: AnchorStudyConfig, learning_rate: float) -> Tuple[optax.GradientTransformation,
                                                                          optax.Schedule]:
  """(optimizer, its schedule) of a cell, built as the trainer builds them (train/build.py): the study's
  optimizer (by default the paper's: AdamW with embeddings decayed too, after clipping, warmup + cosine)
  at peak rate `learning_rate`, its schedule over the study's steps."""
  opt = cfg.cell_optimizer(learning_rate)
  schedule = optimizer_lib.learning_rate_schedule(opt, cfg.steps)
  return optimizer_lib.make_optimizer(opt, cfg.steps, schedule), schedule


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
  """(depth, steps) of every stage of a cell: one stage for "fixed" and "looped" (its depth counts layer
  applications), else `depth` one-layer stages."""
  if arm in ("fixed", "looped"):
    return [(depth, cfg.steps)]
  steps = prop_alpha_steps(cfg.steps, depth, cfg.stage_alpha)
  return [(i + 1, t) for i, t in enumerate(steps)]


def init_params(model: Decoder, key: jax.Array):
  """A fresh draw of `model`'s parameters (its ModelConfig's init: the cell's gamma)."""
  return nn.unbox(model.init(key, decoder_batch(jnp.zeros((1, anchor_task.SEQ_LEN), jnp.int32)))["params"])


def init_state(model: Decoder, tx: optax.GradientTransformation, key: jax.Array) -> TrainState:
  """Step 0: a fresh draw of the parameters and the optimizer's initial state."""
  params = init_params(model, key)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def next_stage(cfg: AnchorStudyConfig, arm: str, gamma: float, depth: int, model: Decoder,
               tx: optax.GradientTransformation, state: TrainState, key: jax.Array) -> Tuple[Decoder, TrainState]:
  """(model, state) of a grown arm's next stage, `depth` layers: the state grown one layer by the arm's
  operator, as the trainer grows it (copied layers keep their Adam moments, the step continues);
  fresh_block's new layer comes from a draw of the deeper model at the cell's gamma init with `key`, with
  zero moments."""
  deeper = Decoder(arm_model(cfg, arm, gamma, depth))
  fresh = None
  if arm == "fresh_block":
    fresh = TrainState(step=state.step, params=init_params(deeper, key), opt_state=None)
  provenance = operators.provenance_for(arm, model.cfg.num_layers, 1)
  _, logical = abstract_state(model, tx, anchor_task.SEQ_LEN)
  return deeper, grow_state(state, logical, provenance, new_moments="copy", fresh_state=fresh)


def train_cell(cfg: AnchorStudyConfig, gamma: float, depth: int, seed: int,
               sets: Optional[EvalSets] = None, arm: str = "fixed", learning_rate: Optional[float] = None) -> dict:
  """Trains one cell; returns its final fractions, its kind, the fractions at every evaluation, its
  training FLOPs and its parameter count. learning_rate: the peak rate (None: the optimizer's).

  A stacked arm evaluates at every `eval_every` steps and at the end of each stage (just before
  the growth), so its trajectory shows what each depth had learned. A fresh_block growth draws the
  deeper model anew from a key of its own (the cell's seed and the stage) and keeps its new layer.
  """
  start = time.time()
  sets = sets or eval_sets(cfg.eval_examples)
  rng = np.random.default_rng(seed)
  train = anchor_task.make_examples(rng, cfg.train_examples, "train")
  tokens, labels = jnp.asarray(train.tokens), jnp.asarray(train.labels)
  learning_rate = cfg.rates[0] if learning_rate is None else float(learning_rate)
  plan = stage_plan(cfg, arm, depth)
  model = Decoder(arm_model(cfg, arm, gamma, plan[0][0]))
  init_key, data_key = jax.random.split(jax.random.key(seed))
  tx, schedule = cell_optimizer(cfg, learning_rate)
  state = init_state(model, tx, init_key)
  every = cfg.eval_every or cfg.steps
  trajectory, done, train_flops = [], 0, 0.0
  for index, (stage_depth, stage_steps) in enumerate(plan):
    if index:
      model, state = next_stage(cfg, arm, gamma, stage_depth, model, tx, state, jax.random.fold_in(init_key, index))
    train_flops += stage_steps * train_flops_per_step(cfg, model.cfg)
    run = train_program(model, tx, schedule, cfg.optimizer.z_loss, cfg.batch_size)
    predict = predictor(model)
    end = done + stage_steps
    while done < end:
      n = min(every - done % every, end - done)
      state, loss = run(state, tokens, labels, data_key, n)
      done += n
      if done % every == 0 or done == end:
        held = np.asarray(predict(state.params, jnp.asarray(sets.held_out.tokens)))
        seen = np.asarray(predict(state.params, jnp.asarray(sets.seen.tokens)))
        trajectory.append(dict(step=done, depth=stage_depth, loss=float(loss), **score(held, seen, sets)))
  final = {k: trajectory[-1][k] for k in ("inferential", "symmetric", "seen")}
  extra = {}
  if arm in GROWN:
    extra = {"stage_alpha": cfg.stage_alpha, "stage_steps": [t for _, t in plan]}
  elif arm == "looped":
    extra = {"loop_block": cfg.loop_block}
  return dict(arm=arm, gamma=float(gamma), learning_rate=learning_rate, depth=int(depth), seed=int(seed), **final,
              kind=classify(final, cfg.fit_threshold), final_loss=trajectory[-1]["loss"],
              train_flops=train_flops, params=int(sum(x.size for x in jax.tree.leaves(state.params))),
              seconds=round(time.time() - start, 1), **extra, trajectory=trajectory)


def train_program(model: Decoder, tx: optax.GradientTransformation, schedule: optax.Schedule, z_loss: float,
                  batch_size: int):
  """run(state, rows, labels, key, steps) -> (state, mean loss): `steps` of the trainer's train step in one
  jitted lax.scan, each on `batch_size` rows drawn by (key, step); the data are arguments, not constants
  baked into the program."""
  train_step = step_lib.make_train_step(model, tx, schedule, z_loss)

  @functools.partial(jax.jit, static_argnums=4)
  def run(state: TrainState, rows: jax.Array, labels: jax.Array, key: jax.Array, steps: int):
    def one_step(state, _):
      idx = jax.random.randint(jax.random.fold_in(key, state.step), (batch_size,), 0, rows.shape[0])
      state, metrics = train_step(state, last_token_batch(rows[idx], labels[idx]))
      return state, metrics["loss"]

    state, losses = jax.lax.scan(one_step, state, length=steps)
    return state, losses.mean()

  return run


def predictor(model: Decoder):
  """predict(params, rows) -> the argmax answer of every row, jitted."""
  return jax.jit(lambda params, rows: jnp.argmax(last_token_logits(model, params, rows), axis=-1))
