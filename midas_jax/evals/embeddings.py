"""The token-embedding space through training: cosine-similarity matrix and a 2-D projection per checkpoint.

Why: Yao, Zhang and Xu (ICML 2025) trace the reasoning bias of small initialization to the embedding
space: with small init, the embeddings of tokens that play different roles in reasoning become
distinguishable early. This suite shows that space for the tokens one can name: digits, letters and
punctuation, each as a single token of the run's vocabulary, at every kept checkpoint of the run (one
model for a params-only export). Per checkpoint: the cosine matrix of those tokens' embedding rows, a
PCA projection (numpy SVD of the centred rows), and the mean pairwise cosine within and between the
groups, the number that shows digits separating from letters over training.
"""

from __future__ import annotations

import string
from typing import Dict, List, Sequence, Tuple

import numpy as np

from midas_jax import fs
from midas_jax.checkpoint import available_steps, is_params_export, load_model
from midas_jax.errors import require
from midas_jax.evals import figures

GROUPS: Tuple[Tuple[str, str], ...] = (
    ("digits", string.digits), ("lower", string.ascii_lowercase), ("upper", string.ascii_uppercase),
    ("punctuation", " .,:;?!=+-*()'\"\n"))
MAX_CHECKPOINTS = 6


def single_token_ids(vocab, groups: Sequence[Tuple[str, str]] = GROUPS) -> Tuple[List[str], List[int], List[str]]:
  """(characters, ids, group of each) for the characters the vocabulary encodes as one token.

  A character whose encoding is not one id (a SentencePiece vocabulary may split or prefix it) is
  left out; a repeated id is kept once.
  """
  chars, ids, names, seen = [], [], [], set()
  for name, members in groups:
    for ch in members:
      encoded = vocab.encode(ch)
      if len(encoded) == 1 and encoded[0] not in seen:
        seen.add(encoded[0])
        chars.append(ch)
        ids.append(int(encoded[0]))
        names.append(name)
  return chars, ids, names


def cosine_similarities(vectors: np.ndarray) -> np.ndarray:
  """[n, n] cosines of the rows (a zero row has cosine 0 with everything)."""
  v = np.asarray(vectors, np.float64)
  norms = np.linalg.norm(v, axis=1)
  unit = v / np.where(norms > 0, norms, 1.0)[:, None]
  return np.clip(unit @ unit.T, -1.0, 1.0)


def pca_2d(vectors: np.ndarray) -> Tuple[np.ndarray, List[float]]:
  """The rows projected on their two leading principal axes, and the variance fraction of each."""
  v = np.asarray(vectors, np.float64)
  centred = v - v.mean(axis=0, keepdims=True)
  _, s, vt = np.linalg.svd(centred, full_matrices=False)
  k = min(2, vt.shape[0])
  coords = centred @ vt[:k].T
  if k < 2:
    coords = np.pad(coords, ((0, 0), (0, 2 - k)))
  total = float(np.sum(s ** 2))
  explained = [float(x ** 2 / total) if total > 0 else 0.0 for x in s[:2]]
  return coords, explained + [0.0] * (2 - len(explained))


def group_similarity(cos: np.ndarray, groups: Sequence[str]) -> Dict[str, float]:
  """Mean cosine within each group (off-diagonal) and between each pair of groups."""
  names = list(dict.fromkeys(groups))
  g = np.asarray(groups)
  out = {}
  for i, a in enumerate(names):
    rows = g == a
    block = cos[np.ix_(rows, rows)]
    n = int(rows.sum())
    if n > 1:
      out[f"{a}/{a}"] = round(float((block.sum() - np.trace(block)) / (n * (n - 1))), 4)
    for b in names[i + 1:]:
      out[f"{a}/{b}"] = round(float(cos[np.ix_(rows, g == b)].mean()), 4)
  return out


def embedding_table(params) -> np.ndarray:
  """The input embedding [vocab, d_model] (also the output head when embeddings are tied)."""
  return np.asarray(params["embedding"], np.float32)


def analyse(params, ids: Sequence[int], groups: Sequence[str]) -> Dict[str, object]:
  rows = embedding_table(params)[np.asarray(ids)]
  cos = cosine_similarities(rows)
  coords, explained = pca_2d(rows)
  return {"cosine": cos, "pca": coords, "explained_variance": explained, "groups": group_similarity(cos, groups),
          "mean_norm": float(np.linalg.norm(rows, axis=1).mean())}


def pick_steps(steps: Sequence[int], most: int) -> List[int]:
  """At most `most` steps, evenly spread, always keeping the last (and the first when most >= 2)."""
  steps = sorted(steps)
  if len(steps) <= most:
    return steps
  if most <= 1:
    return steps[-1:]
  index = np.unique(np.round(np.linspace(0, len(steps) - 1, most)).astype(int))
  return [steps[i] for i in index]


def _plot(points: List[dict], chars: List[str], groups: List[str], path: str) -> None:
  plt = figures.pyplot()
  names = list(dict.fromkeys(groups))
  colors = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(names)}
  shown = [repr(c)[1:-1] for c in chars]
  fig, axes = plt.subplots(2, len(points), figsize=(4.2 * len(points), 8.2), squeeze=False)
  for col, point in enumerate(points):
    ax = axes[0, col]
    ax.imshow(point["cosine"], cmap="RdBu_r", vmin=-1, vmax=1)
    ax.set_title(f"step {point['step']}: embedding cosine", fontsize=9)
    ticks = range(0, len(chars), max(1, len(chars) // 24))
    ax.set_xticks(list(ticks), [shown[i] for i in ticks], fontsize=6)
    ax.set_yticks(list(ticks), [shown[i] for i in ticks], fontsize=6)
    ax = axes[1, col]
    for (x, y), ch, g in zip(point["pca"], shown, groups):
      ax.text(x, y, ch, color=colors[g], fontsize=8, ha="center", va="center")
    pca = np.asarray(point["pca"])
    pad = 0.1 * (np.ptp(pca, axis=0) + 1e-9)
    ax.set_xlim(pca[:, 0].min() - pad[0], pca[:, 0].max() + pad[0])
    ax.set_ylim(pca[:, 1].min() - pad[1], pca[:, 1].max() + pad[1])
    ev = point["explained_variance"]
    ax.set_title(f"PCA ({ev[0]:.0%} + {ev[1]:.0%} of variance)", fontsize=9)
  handles = [plt.Line2D([], [], color=colors[n], marker="s", ls="", label=n) for n in names]
  fig.legend(handles=handles, loc="lower center", ncol=len(names), fontsize=8)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fs.write_figure(path, fig, dpi=90)
  plt.close(fig)


def _checkpoints(model, workdir: str, most: int):
  """(step, LoadedModel) for up to `most` kept checkpoints of the run; just `model` for an export."""
  if is_params_export(fs.absolute(workdir, "--workdir")):
    return [(model.step, model)]
  steps = pick_steps(available_steps(workdir), most)
  if not steps:
    return [(model.step, model)]
  return [(s, model if s == model.step else load_model(workdir, step=s)) for s in steps]


def run_suite(model, workdir: str, out_dir: str, options: dict) -> dict:
  """Embedding cosine matrices and PCA projections at up to `max_checkpoints` (default 6) kept steps.

  options: max_checkpoints; embedding_tokens, a string of characters to show instead of GROUPS.

  Writes embeddings.png (one column per step) and returns, per step, the within/between-group mean
  cosines, the PCA coordinates and variance fractions (the full cosine matrices are in the PNG).
  """
  fs.makedirs(out_dir)
  chosen = options.get("embedding_tokens")
  chars, ids, groups = single_token_ids(model.vocab, (("chosen", str(chosen)),) if chosen else GROUPS)
  require(len(ids) >= 2, "embedding_tokens", f"only {len(ids)} of the characters are single tokens",
          "name at least two characters the vocabulary encodes as one token each")
  most = int(options.get("max_checkpoints") or MAX_CHECKPOINTS)
  points = []
  for step, loaded in _checkpoints(model, workdir, most):
    point = analyse(loaded.params, ids, groups)
    points.append(dict(point, step=step, stage=loaded.stage))
  _plot(points, chars, groups, fs.join(out_dir, "embeddings.png"))
  return {
      "tokens": chars, "token_ids": ids, "token_groups": groups,
      "steps": [p["step"] for p in points],
      "group_similarity": {str(p["step"]): p["groups"] for p in points},
      "points": [{"step": p["step"], "stage": p["stage"],
                  "explained_variance": [round(x, 4) for x in p["explained_variance"]],
                  "mean_norm": round(p["mean_norm"], 4), "pca": np.round(p["pca"], 4).tolist()}
                 for p in points],
      "plots": ["embeddings.png"],
  }
