"""optax optimizer and learning-rate schedule built from an OptimizerConfig."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from midas_jax.configs import OptimizerConfig

EMBEDDING_PARAMS = ("embedding", "position_embedding")


def learning_rate_schedule(cfg: OptimizerConfig, num_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then the configured decay until num_steps."""
  peak, warmup = cfg.learning_rate, cfg.warmup_steps
  decay_steps = max(num_steps - warmup, 1)
  final = peak * cfg.final_lr_fraction
  if cfg.decay == "cosine":
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


def make_optimizer(cfg: OptimizerConfig, num_steps: int) -> optax.GradientTransformation:
  schedule = learning_rate_schedule(cfg, num_steps)
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
