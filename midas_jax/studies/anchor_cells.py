"""One cell of the anchor-function study: a model trained on the task and scored on unseen rows.

One cell = one (arm, gamma, depth, seed): a fresh Decoder with ModelConfig(init="gamma") trained by
the study's optimizer on the loss of the last token only, at `depth` throughout (arm "fixed") or
grown to it from one layer by MIDAS or GradStack, one layer per stage (the same gather along the
`layers` axis as the trainer's, stacking/grow.py). Its score, on test-split rows nobody trained on:
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

from midas_jax import optimizer as optimizer_lib
from midas_jax.configs import ModelConfig
from midas_jax.model import Decoder
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
  return cfg.cell_model(gamma, depth, anchor_task.VOCAB_SIZE, anchor_task.SEQ_LEN)


def decoder_batch(tokens: jax.Array) -> Dict[str, jax.Array]:
  """The Decoder's batch format for plain causal rows (every token real, no bidirectional prefix)."""
  b, t = tokens.shape
  return {"inputs": tokens, "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
          "segment_ids": jnp.ones((b, t), jnp.int32), "prefix_mask": jnp.zeros((b, t), jnp.bool_)}


def last_token_logits(model: Decoder, params, tokens: jax.Array) -> jax.Array:
  """Logits at the last position, [b, 100]: the task's one answer token."""
  return model.apply({"params": params}, decoder_batch(tokens))[:, -1, :anchor_task.VOCAB_SIZE]


def make_optimizer(cfg: AnchorStudyConfig) -> optax.GradientTransformation:
  """The study's optimizer over its steps (by default the paper's: AdamW with embeddings decayed
  too, after clipping, warmup + cosine)."""
  return optimizer_lib.make_optimizer(cfg.optimizer, cfg.steps)


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
