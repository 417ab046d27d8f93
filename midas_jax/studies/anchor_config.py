"""The settings of the anchor-function study (studies/anchor_study.py trains them, on studies/anchor_task.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Tuple

from midas_jax import gin_config
from midas_jax.configs import ModelConfig, OptimizerConfig
from midas_jax.errors import require

GAMMA_RANGE = (0.05, 3.0)
# fixed depth throughout; grown by that operator (fresh_block: a new layer drawn at the gamma init on
# top, the control for copying); or a weight-tied looped model (the control for stacking's likeness to looping)
GROWN = ("midas", "gradstack", "fresh_block")
ARMS = ("fixed",) + GROWN + ("looped",)

# The paper's cells (Zhang et al.): a gpt2-family decoder of width 64 and one head, in float32,
# trained by AdamW (PyTorch's betas, embeddings decayed too) after clipping, warmup + cosine.
ANCHOR_MODEL = ModelConfig(family="gpt2", d_model=64, num_heads=1, d_ff=256, dtype="float32")
ANCHOR_OPTIMIZER = OptimizerConfig(learning_rate=1e-3, warmup_steps=100, decay="cosine", final_lr_fraction=0.1,
                                   b2=0.999, weight_decay=0.01, decay_embeddings=True, grad_clip_norm=1.0)


@dataclasses.dataclass(frozen=True)
class AnchorStudyConfig:
  """The (arm x) gamma x learning rate x depth grid of the anchor-function study, and how each cell's
  model is trained.

  Every cell trains a fresh Decoder of `model` (with init="gamma", init_gamma=gamma, num_layers=depth
  and the task's vocabulary and length) once per seed on `train_examples` fixed training rows, with
  `optimizer` at the cell's peak learning rate (its schedule over `steps`) and the loss on the last
  token only, and is scored on `eval_examples` test-split rows per pair. A cell whose seen-pair test
  accuracy is below `fit_threshold` did not fit the task and is shaded in the phase diagram.

  learning_rates: the peak rates of the grid; empty (the default) is the one rate `optimizer` has.
  arms: "fixed" trains at `depth` throughout; "midas", "gradstack" and "fresh_block" start from one
  layer and grow by that operator in `depth` stages of one-layer blocks (Prop-`stage_alpha` stage
  lengths, one learning-rate schedule over all steps), ending at `depth` layers after the same
  `steps`. MIDAS and GradStack copy a layer (with its Adam moments); fresh_block puts a new layer on
  top drawn at the same gamma init (zero moments), so gradstack vs fresh_block is copying vs growing,
  the layer placed alike. "looped" is a weight-tied looped model: `loop_block` unique layers applied
  depth / loop_block times (anchor_cells.arm_model has why), at the final depth's compute every step.
  """

  gammas: Tuple[float, ...] = (0.3, 0.5, 0.7, 0.9)
  depths: Tuple[int, ...] = (2, 3)
  seeds: Tuple[int, ...] = (0,)
  learning_rates: Tuple[float, ...] = ()
  arms: Tuple[str, ...] = ("fixed",)
  stage_alpha: float = 1.0
  loop_block: int = 1
  model: ModelConfig = ANCHOR_MODEL
  optimizer: OptimizerConfig = ANCHOR_OPTIMIZER
  train_examples: int = 300_000
  batch_size: int = 512
  steps: int = 1000
  eval_every: int = 250
  eval_examples: int = 256
  fit_threshold: float = 0.9

  def __post_init__(self):
    s = "AnchorStudyConfig."
    object.__setattr__(self, "learning_rates", tuple(self.learning_rates))  # gin hands over lists
    for name in ("gammas", "depths", "seeds", "arms"):
      object.__setattr__(self, name, tuple(getattr(self, name)))
      require(len(getattr(self, name)) > 0, s + name, "is empty", f"list at least one value in {s}{name}")
    require(all(isinstance(r, (int, float)) and math.isfinite(r) and r > 0 for r in self.learning_rates)
            and len(set(self.learning_rates)) == len(self.learning_rates), s + "learning_rates",
            f"must be distinct positive rates, got {self.learning_rates}",
            "e.g. learning_rates = [3e-3, 2e-3], or [] for OptimizerConfig.learning_rate alone")
    require(all(GAMMA_RANGE[0] <= g <= GAMMA_RANGE[1] for g in self.gammas), s + "gammas",
            f"{self.gammas} leave [{GAMMA_RANGE[0]}, {GAMMA_RANGE[1]}]",
            "use init rates such as 0.3 to 1.0 (std = d_in ** -gamma: larger gamma is a smaller init)")
    require(all(isinstance(d, int) and d >= 1 for d in self.depths), s + "depths",
            f"must be positive ints, got {self.depths}", "e.g. depths = [2, 3]")
    require(all(isinstance(x, int) and x >= 0 for x in self.seeds), s + "seeds",
            f"must be non-negative ints, got {self.seeds}", "e.g. seeds = [0, 1]")
    require(all(a in ARMS for a in self.arms) and len(set(self.arms)) == len(self.arms), s + "arms",
            f"{self.arms} are not distinct names of {ARMS}", f"list some of {ARMS}, e.g. arms = ['fixed', 'midas']")
    stacked = [a for a in self.arms if a in GROWN]
    require(not stacked or min(self.depths) >= 2, s + "depths",
            f"the stacked arms {stacked} grow one-layer blocks in `depth` stages, so every depth must be >= 2, "
            f"got {self.depths}", "use depths >= 2 with stacked arms (e.g. depths = [4])")
    require(not stacked or self.steps >= max(self.depths), s + "steps",
            f"{self.steps} steps cannot give each of {max(self.depths)} stages a step", "train longer")
    require(isinstance(self.loop_block, int) and self.loop_block >= 1, s + "loop_block",
            f"must be a positive int, got {self.loop_block!r}", "1 ties every layer of the looped arm")
    looped_ok = all(d % self.loop_block == 0 and d > self.loop_block for d in self.depths)
    require("looped" not in self.arms or looped_ok, s + "loop_block",
            f"the looped arm applies loop_block={self.loop_block} layers depth / loop_block >= 2 times, which "
            f"needs every depth a multiple of it and above it, got depths {self.depths}",
            "use loop_block = 1, or depths that are multiples (>= 2x) of loop_block")
    require(math.isfinite(self.stage_alpha), s + "stage_alpha", f"must be finite, got {self.stage_alpha}",
            "1.0 is Prop-1, 0.0 equal stages")
    for name in ("train_examples", "batch_size", "steps", "eval_examples"):
      value = getattr(self, name)
      require(isinstance(value, int) and value > 0, s + name, f"must be a positive int, got {value!r}",
              f"set {s}{name} to a positive integer")
    require(self.optimizer.warmup_steps < self.steps, "OptimizerConfig.warmup_steps",
            f"must be below AnchorStudyConfig.steps={self.steps}", "warm up over a fraction of the steps, e.g. 100")
    require(isinstance(self.eval_every, int) and self.eval_every >= 0, s + "eval_every",
            "must be an int >= 0", "0 evaluates only at the end")
    require(0 < self.fit_threshold <= 1, s + "fit_threshold", "must be in (0, 1]", "the paper shades below 0.9")

  @property
  def rates(self) -> Tuple[float, ...]:
    """The grid's peak learning rates: learning_rates, or the optimizer's one rate."""
    return tuple(float(r) for r in self.learning_rates) or (float(self.optimizer.learning_rate),)

  @property
  def grid_cells(self) -> Tuple[Tuple[float, float], ...]:
    """The (gamma, learning rate) cells of the grid, gamma major."""
    return tuple((float(g), r) for g in self.gammas for r in self.rates)

  @property
  def num_cells(self) -> int:
    return len(self.arms) * len(self.grid_cells) * len(self.depths) * len(self.seeds)

  def cell_optimizer(self, learning_rate: float) -> OptimizerConfig:
    """`optimizer` at one of the grid's peak rates."""
    return dataclasses.replace(self.optimizer, learning_rate=float(learning_rate))

  def cell_model(self, gamma: float, depth: int, vocab_size: int, seq_len: int) -> ModelConfig:
    """The model of one cell: `model` at `depth` layers, initialized at rate `gamma`, for the task."""
    return dataclasses.replace(self.model, vocab_size=vocab_size, num_layers=depth, max_seq_len=seq_len,
                               init="gamma", init_gamma=float(gamma))


gin_config.register(AnchorStudyConfig)  # `AnchorStudyConfig.gammas = [...]` in gin files and --gin flags
