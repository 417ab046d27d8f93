"""One cell of the anchor-function study: a model trained on the task and scored on unseen rows.

One cell = one (arm, gamma, learning rate, depth, seed): a fresh Decoder with ModelConfig(init="gamma")
trained by the study's optimizer at that peak rate on the loss of the last token only, at `depth`
throughout (arm "fixed"), grown to it from one layer, one layer per stage, by MIDAS, GradStack or
fresh_block (the same gather along the `layers` axis as the trainer's, stacking/grow.py; fresh_block's
new layer is drawn at the cell's gamma init), or as a weight-tied looped model of `depth` layer
applications (arm_model). Its score, on test-split rows nobody trained on:
  inferential  fraction of held-out (4, 3) rows answered key-10 (the composite: reasoning)
  symmetric    fraction answered key-6 (the rule of the mirror pair (3, 4): memorizing)
  seen         accuracy on the 15 training pairs (did the model fit the task at all?)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from midas_jax import flops
from midas_jax import optimizer as optimizer_lib
from midas_jax.configs import ModelConfig
from midas_jax.model import Decoder
from midas_jax.sharding import mirror_param_specs
from midas_jax.stacking import operators
from midas_jax.stacking.grow import grow_state
from midas_jax.stacking.schedule import prop_alpha_steps
from midas_jax.studies import anchor_task
from midas_jax.studies.anchor_config import GROWN, AnchorStudyConfig
from midas_jax.train_state import TrainState

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


def last_token_logits(model: Decoder, params, tokens: jax.Array) -> jax.Array:
  """Logits at the last position, [b, 100]: the task's one answer token."""
  return model.apply({"params": params}, decoder_batch(tokens))[:, -1, :anchor_task.VOCAB_SIZE]


def make_optimizer(cfg: AnchorStudyConfig,
                   learning_rate: Optional[float] = None) -> optax.GradientTransformation:
  """The study's optimizer over its steps at peak rate `learning_rate` (None: the optimizer's own; by
  default the paper's: AdamW with embeddings decayed too, after clipping, warmup + cosine)."""
  opt = cfg.optimizer if learning_rate is None else cfg.cell_optimizer(learning_rate)
  return optimizer_lib.make_optimizer(opt, cfg.steps)


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


def _logical_state(model: Decoder, tx: optax.GradientTransformation, params) -> TrainState:
  """The logical axis names of (params, optimizer state): where growth finds each `layers` axis."""
  boxed = jax.eval_shape(model.init, jax.random.key(0), decoder_batch(jnp.zeros((1, anchor_task.SEQ_LEN), jnp.int32)))
  specs = nn.get_partition_spec(boxed["params"])
  opt_shapes = jax.eval_shape(tx.init, params)
  return TrainState(step=P(), params=specs, opt_state=mirror_param_specs(opt_shapes, params, specs))


def init_params(model: Decoder, key: jax.Array):
  """A fresh draw of `model`'s parameters (its ModelConfig's init: the cell's gamma)."""
  return nn.unbox(model.init(key, decoder_batch(jnp.zeros((1, anchor_task.SEQ_LEN), jnp.int32)))["params"])


def grow(model: Decoder, tx, params, opt_state, operator: str, fresh_params=None):
  """(params, opt_state) one layer deeper, grown by `operator`: copied layers keep their moments; a
  fresh layer (fresh_block) takes its rows of `fresh_params`, a draw of the deeper model at the same
  init, and zero moments."""
  depth = model.cfg.num_layers
  provenance = operators.provenance_for(operator, depth, 1)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
  fresh = None if fresh_params is None else TrainState(step=state.step, params=fresh_params, opt_state=None)
  grown = grow_state(state, _logical_state(model, tx, params), provenance, new_moments="copy", fresh_state=fresh)
  return grown.params, grown.opt_state


def next_stage(cfg: AnchorStudyConfig, arm: str, gamma: float, depth: int, model: Decoder, tx, params, opt_state,
               key: jax.Array):
  """(model, params, opt_state) of a grown arm's next stage, `depth` layers: grown by the arm's operator;
  fresh_block's new layer comes from a draw of the deeper model at the cell's gamma init with `key`."""
  deeper = Decoder(arm_model(cfg, arm, gamma, depth))
  fresh = init_params(deeper, key) if arm == "fresh_block" else None
  params, opt_state = grow(model, tx, params, opt_state, arm, fresh)
  return deeper, params, opt_state


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
  params = init_params(model, init_key)
  tx = make_optimizer(cfg, learning_rate)
  opt_state = tx.init(params)
  every = cfg.eval_every or cfg.steps
  trajectory, done, train_flops = [], 0, 0.0
  for index, (stage_depth, stage_steps) in enumerate(plan):
    if index:
      model, params, opt_state = next_stage(cfg, arm, gamma, stage_depth, model, tx, params, opt_state,
                                            jax.random.fold_in(init_key, index))
    train_flops += stage_steps * train_flops_per_step(cfg, model.cfg)
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
  extra = {}
  if arm in GROWN:
    extra = {"stage_alpha": cfg.stage_alpha, "stage_steps": [t for _, t in plan]}
  elif arm == "looped":
    extra = {"loop_block": cfg.loop_block}
  return dict(arm=arm, gamma=float(gamma), learning_rate=learning_rate, depth=int(depth), seed=int(seed), **final,
              kind=classify(final, cfg.fit_threshold), final_loss=trajectory[-1]["loss"],
              train_flops=train_flops, params=int(sum(x.size for x in jax.tree.leaves(params))),
              seconds=round(time.time() - start, 1), **extra, trajectory=trajectory)


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
