"""The optax optimizer and its learning-rate schedule."""

from __future__ import annotations

import dataclasses
from typing import Optional

from midas_jax.errors import require


DECAYS = ("cosine", "linear", "rsqrt", "constant", "wsd")
OPTIMIZERS = ("adamw", "adafactor")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """optax optimizer and learning-rate schedule: linear warmup, then the chosen decay.

  decay "cosine" and "linear" fall to final_lr_fraction * learning_rate at the last step; "rsqrt"
  scales by sqrt(warmup_steps / step) after warmup; "constant" holds the peak; "wsd"
  (warmup-stable-decay) holds the peak, then falls linearly to final_lr_fraction * learning_rate
  over the last decay_fraction of the steps (the usual schedule for runs that grow or continue: the
  rate does not depend on how long the run will be until its last stretch).
  Weight decay skips norms and biases always, and embedding tables unless decay_embeddings.
  """

  name: str = "adamw"
  learning_rate: float = 3e-3
  warmup_steps: int = 100
  decay: str = "cosine"
  final_lr_fraction: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  decay_fraction: float = 0.2
  decay_embeddings: bool = False
  grad_clip_norm: Optional[float] = 1.0
  z_loss: float = 0.0

  def __post_init__(self):
    s = "OptimizerConfig."
    require(self.name in OPTIMIZERS, s + "name", f"unknown optimizer {self.name!r}",
            f"use one of {OPTIMIZERS}")
    require(self.decay in DECAYS, s + "decay", f"unknown decay {self.decay!r}", f"use one of {DECAYS}")
    require(self.learning_rate > 0, s + "learning_rate", "must be > 0", "typical values: 1e-4 to 3e-3")
    require(self.warmup_steps >= 0, s + "warmup_steps", "must be >= 0", "set it to 0 for no warmup")
    require(0 <= self.final_lr_fraction <= 1, s + "final_lr_fraction", "must be in [0, 1]",
            "0.1 is a common choice")
    require(self.grad_clip_norm is None or self.grad_clip_norm > 0, s + "grad_clip_norm",
            "must be > 0 or None", "use None to turn clipping off")
    for name in ("b1", "b2"):
      require(0 <= getattr(self, name) < 1, s + name, f"must be in [0, 1), got {getattr(self, name)}",
              "typical: b1 = 0.9, b2 = 0.95 to 0.999 (1.0 divides by zero in Adam's bias correction)")
    require(self.eps > 0, s + "eps", f"must be > 0, got {self.eps}", "1e-8 is the usual value")
    require(self.weight_decay >= 0, s + "weight_decay", f"must be >= 0, got {self.weight_decay}",
            "0 turns weight decay off; 0.1 is common")
    require(self.z_loss >= 0, s + "z_loss", "must be >= 0", "1e-4 is the t5x default; 0 turns it off")
    require(0 < self.decay_fraction <= 1, s + "decay_fraction", f"must be in (0, 1], got {self.decay_fraction}",
            "0.1 to 0.2 is usual for decay='wsd' (it is read by no other decay)")
