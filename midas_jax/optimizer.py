"""optax optimizer and learning-rate schedule built from an OptimizerConfig."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from midas_jax.configs import OptimizerConfig
from midas_jax.errors import require

EMBEDDING_PARAMS = ("embedding", "position_embedding")


def wsd_decay_steps(cfg: OptimizerConfig, num_steps: int) -> int:
  """Steps of the final decay of a warmup-stable-decay schedule; they must not overlap the warmup."""
  decay_steps = max(int(round(cfg.decay_fraction * num_steps)), 1)
  require(cfg.warmup_steps + decay_steps <= num_steps, "OptimizerConfig.decay_fraction",
          f"warmup ({cfg.warmup_steps} steps) and the wsd decay ({decay_steps} = {cfg.decay_fraction} x "
          f"{num_steps} steps) overlap", "lower OptimizerConfig.warmup_steps or decay_fraction, or train longer")
  return decay_steps


def learning_rate_schedule(cfg: OptimizerConfig, num_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then the configured decay until num_steps."""
  peak, warmup = cfg.learning_rate, cfg.warmup_steps
  decay_steps = max(num_steps - warmup, 1)
  final = peak * cfg.final_lr_fraction
  if cfg.decay == "wsd":
    tail = wsd_decay_steps(cfg, num_steps)
    stable = optax.constant_schedule(peak)
    decay = optax.join_schedules([stable, optax.linear_schedule(peak, final, tail)],
                                 [num_steps - tail - warmup])
  elif cfg.decay == "cosine":
    decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.final_lr_fraction)
  elif cfg.decay == "linear":
    decay = optax.linear_schedule(peak, final, decay_steps)
  elif cfg.decay == "rsqrt":
    base = max(warmup, 1)
    decay = lambda step: peak * jnp.sqrt(base / (step + base))
  else:
    decay = optax.constant_schedule(peak)
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def with_rewarm(schedule: optax.Schedule, starts: Sequence[int], rewarm_steps: int) -> optax.Schedule:
  """The schedule scaled by a linear ramp from 0 to 1 over rewarm_steps after each step in `starts`.

  Re-warming the learning rate after each stacking growth, as Reddi et al. (2023) restart warmup per
  stage; the global schedule otherwise continues (the step count never resets).
  """
  if not starts or rewarm_steps <= 0:
    return schedule
  starts_arr = jnp.asarray(sorted(starts), jnp.int32)

  def rewarmed(step):
    began = jnp.where(starts_arr <= step, starts_arr, -1).max()
    ramp = jnp.clip((step - began + 1) / rewarm_steps, 0.0, 1.0)
    return schedule(step) * jnp.where(began >= 0, ramp, 1.0)

  return rewarmed


def weight_decay_mask(params: Any, decay_embeddings: bool) -> Any:
  """True for the leaves weight decay applies to: weight matrices, and embeddings if asked.

  Norm scales and biases are never decayed.
  """

  def decays(path, _):
    name = str(getattr(path[-1], "key", path[-1]))
    if name == "scale" or name == "bias" or name.endswith("_bias"):
      return False
    if name in EMBEDDING_PARAMS:
      return decay_embeddings
    return True

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimizerConfig, num_steps: int,
                   schedule: Optional[optax.Schedule] = None) -> optax.GradientTransformation:
  """schedule: the learning rate by step; None builds learning_rate_schedule(cfg, num_steps)."""
  schedule = schedule or learning_rate_schedule(cfg, num_steps)
  mask = lambda params: weight_decay_mask(params, cfg.decay_embeddings)
  if cfg.name == "adamw":
    opt = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask)
  else:
    # optax adds weight_decay_rate * param after the lr scaling: scale it by the schedule, as AdamW does.
    wd = (lambda step: cfg.weight_decay * schedule(step)) if cfg.weight_decay else None
    opt = optax.adafactor(schedule, weight_decay_rate=wd, weight_decay_mask=mask)
  if cfg.grad_clip_norm is None:
    return opt
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), opt)
