"""Cosine similarity between the weights of every pair of layers and of blocks, as heatmaps.

Why: a stacked model is grown by copying blocks, and copies stay similar for a while; MIDAS (copy the
middle block) should show its most recently duplicated middle blocks as similar, GradStack (copy the
top block) its top blocks, the structure Saunshi et al. (2024) compare with a looped model's.

Measure (the paper's exact one was not found, see docs/papers.md#stacking-and-looped-models): for each weight-matrix
type of a layer (attn query/key/value/out, mlp gate/up/down or fc/proj), the cosine between two
layers' flattened matrices; "mean" averages the types. A block's vector for a type is its layers'
matrices concatenated in order, so two blocks compare layer k with layer k. Norm scales and biases
are left out: scales start at 1 in every layer, so their cosine is near 1 whatever the training did.
Everything under params["layers"] carries the leading layers axis of the scanned stack (docs/architecture.md#stacked-layers).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from midas_jax import fs
from midas_jax.errors import ConfigError, require
from midas_jax.evals import figures
from midas_jax.stacking import operators


def _is_weight_matrix(name: str) -> bool:
  return name not in ("scale", "bias") and not name.endswith("_bias")


def layer_weights(params: Any) -> Dict[str, np.ndarray]:
  """{"attn/query": [L, ...], ...}: every per-layer weight matrix of the stack, keyed by its path."""
  out: Dict[str, np.ndarray] = {}

  def walk(tree, prefix):
    for key in sorted(tree):
      value = tree[key]
      path = f"{prefix}/{key}" if prefix else key
      if hasattr(value, "keys"):
        walk(value, path)
      elif _is_weight_matrix(key):
        out[path] = np.asarray(value, np.float32)

  require("layers" in params, "params", "no 'layers' subtree", "pass a Decoder's unboxed params")
  walk(params["layers"], "")
  return out


def cosine_matrix(stack: np.ndarray) -> np.ndarray:
  """[n, n] cosine similarities between the rows of `stack` ([n, ...], flattened per row).

  A row of zeros has similarity 0 with everything (itself included): it has no direction.
  """
  flat = np.asarray(stack, np.float64).reshape(stack.shape[0], -1)
  norms = np.linalg.norm(flat, axis=1)
  unit = flat / np.where(norms > 0, norms, 1.0)[:, None]
  return np.clip(unit @ unit.T, -1.0, 1.0)


def _as_blocks(stack: np.ndarray, block_size: int) -> np.ndarray:
  layers = stack.shape[0]
  require(block_size >= 1 and layers % block_size == 0, "block_size",
          f"{block_size} does not divide the depth {layers}", "use the run's StackingConfig.block_size")
  return stack.reshape(layers // block_size, -1)


def similarity(params: Any, block_size: int = 1) -> Dict[str, Any]:
  """{"per_matrix": {name: [n, n]}, "mean": [n, n]} over blocks of `block_size` layers (1: layers)."""
  per = {name: cosine_matrix(_as_blocks(w, block_size)) for name, w in layer_weights(params).items()}
  return {"per_matrix": per, "mean": np.mean(list(per.values()), axis=0)}


def last_growth_provenance(operator: str, num_stages: int, block_size: int, stage: int,
                           start_blocks: int = 1) -> Optional[np.ndarray]:
  """The provenance map of the growth that made `stage` (None for stage 1): replayed from the operator."""
  if stage <= 1:
    return None
  depths = operators.stage_depths(operator, num_stages, block_size, start_blocks)
  return operators.provenance_for(operator, depths[stage - 2], block_size)


def copied_block_pairs(provenance: Sequence[int], block_size: int) -> List[Tuple[int, int]]:
  """(source block, copy block) in the grown model, for every block a growth added by copying.

  The source is the block holding its layers' first occurrence (operators.new_layer_mask); fresh
  blocks (-1) have no source and are left out.
  """
  prov = np.asarray(provenance)
  first = {}
  for j, p in enumerate(prov.tolist()):
    first.setdefault(p, j)
  pairs = []
  for block in range(len(prov) // block_size):
    rows = prov[block * block_size:(block + 1) * block_size]
    if (rows < 0).any() or first[int(rows[0])] == block * block_size:
      continue
    pairs.append((first[int(rows[0])] // block_size, block))
  return pairs


def _off_diagonal_mean(m: np.ndarray) -> Optional[float]:
  n = m.shape[0]
  return None if n < 2 else float((m.sum() - np.trace(m)) / (n * (n - 1)))


def _most_similar_pair(m: np.ndarray) -> Optional[List[float]]:
  n = m.shape[0]
  if n < 2:
    return None
  masked = np.where(np.eye(n, dtype=bool), -np.inf, m)
  i, j = np.unravel_index(int(np.argmax(masked)), m.shape)
  return [int(min(i, j)), int(max(i, j)), round(float(m[i, j]), 4)]


def _rounded(m: np.ndarray) -> list:
  return np.round(m, 4).tolist()


def plot_heatmaps(matrices: Dict[str, np.ndarray], path: str, title: str, axis_label: str,
                  marks: Sequence[Tuple[int, int]] = ()) -> None:
  """One heatmap per entry (cosine in [-1, 1]), values written in cells when the matrix is small."""
  plt = figures.pyplot()
  names = list(matrices)
  cols = min(4, len(names))
  rows = -(-len(names) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.2 * rows), squeeze=False)
  for ax in axes.ravel()[len(names):]:
    ax.axis("off")
  for ax, name in zip(axes.ravel(), names):
    m = matrices[name]
    im = ax.imshow(m, cmap="viridis", vmin=-1 if m.min() < 0 else 0, vmax=1)
    if m.shape[0] <= 12:
      for (i, j), v in np.ndenumerate(m):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.6 else "k")
    for i, j in marks:
      for a, b in ((i, j), (j, i)):
        ax.add_patch(plt.Rectangle((b - 0.5, a - 0.5), 1, 1, fill=False, ec="red", lw=1.5))
    step = max(1, m.shape[0] // 12)
    ax.set_xticks(range(0, m.shape[0], step))
    ax.set_yticks(range(0, m.shape[0], step))
    ax.set_title(name, fontsize=9)
    ax.set_xlabel(axis_label, fontsize=8)
    ax.set_ylabel(axis_label, fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.046)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=100)
  plt.close(fig)


def _block_size(model, options: dict) -> int:
  if options.get("block_size") is not None:
    try:
      return int(options["block_size"])
    except (TypeError, ValueError):
      raise ConfigError("block_size", f"not an integer: {options['block_size']!r}",
                        "pass a positive number of layers per block") from None
  stacking = model.config.stacking
  if stacking.num_stages == 1:
    return 1  # an unstacked run has no blocks of its own: compare layers
  return stacking.resolved_block_size(model.config.model.num_layers)


def run_suite(model, workdir: str, out_dir: str, options: dict) -> dict:
  """Layer and block similarity of one checkpoint; PNGs similarity_layers.png, similarity_blocks.png.

  options: block_size (default: the run's StackingConfig block size; 1 for an unstacked run).
  The growth that made the current stage is replayed from the config, so its copied block pairs are
  named (and outlined in red): right after growth they have similarity 1, and they drift apart with
  training.
  """
  del workdir
  fs.makedirs(out_dir)
  block_size = _block_size(model, options)
  depth = model.model_config.num_layers
  require(block_size >= 1 and depth % block_size == 0, "block_size",
          f"{block_size} does not divide the depth {depth}", "pass a block size that divides the depth")
  layers = similarity(model.params, 1)
  blocks = similarity(model.params, block_size)
  stacking = model.config.stacking
  prov = None
  if stacking.num_stages > 1 and model.stage > 1 and block_size == _block_size(model, {}):
    prov = last_growth_provenance(stacking.operator, stacking.num_stages, block_size, model.stage,
                                  stacking.start_blocks)
  pairs = copied_block_pairs(prov, block_size) if prov is not None and len(prov) == depth else []
  result = {
      "step": model.step, "stage": model.stage, "depth": depth, "block_size": block_size,
      "operator": stacking.operator if stacking.num_stages > 1 else None,
      "matrices": list(layers["per_matrix"]),
      "layers": {"mean": _rounded(layers["mean"]),
                 "per_matrix": {k: _rounded(v) for k, v in layers["per_matrix"].items()},
                 "off_diagonal_mean": _off_diagonal_mean(layers["mean"]),
                 "most_similar": _most_similar_pair(layers["mean"])},
      "blocks": {"mean": _rounded(blocks["mean"]),
                 "per_matrix": {k: _rounded(v) for k, v in blocks["per_matrix"].items()},
                 "off_diagonal_mean": _off_diagonal_mean(blocks["mean"]),
                 "most_similar": _most_similar_pair(blocks["mean"])},
      "last_growth": None,
  }
  if pairs:
    result["last_growth"] = {"block_pairs": [list(p) for p in pairs],
                             "similarity": [round(float(blocks["mean"][i, j]), 4) for i, j in pairs]}
  label = f"step {model.step}, stage {model.stage}, depth {depth}"
  plot_heatmaps(dict(mean=layers["mean"], **layers["per_matrix"]), fs.join(out_dir, "similarity_layers.png"),
                f"layer weight cosine similarity ({label})", "layer")
  plot_heatmaps({"mean": blocks["mean"]}, fs.join(out_dir, "similarity_blocks.png"),
                f"block weight cosine similarity, {block_size} layers per block ({label}); "
                "red: last growth's copies", "block", marks=pairs)
  result["plots"] = ["similarity_layers.png", "similarity_blocks.png"]
  return result
