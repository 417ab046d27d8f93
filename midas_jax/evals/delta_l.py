"""Delta L through training: how far the loss on data set A trails (or leads) the loss on data set B.

Yao, Zhang and Xu (ICML 2025) train on a mixture of reasoning data (PrOntoQA) and memory data
(TinyStories) and find that with small initialization the reasoning loss falls much faster. Their
exact metric was not found (docs/papers.md#the-reasoning-bias-of-small-initialization); this suite reports the relative gap
Delta L = (L_A - L_B) / L_B, the causal-LM loss per target token of A's held-out documents against
B's, at every kept checkpoint of a run. Negative Delta L: A is the better-predicted data set.

A and B: for the built-in corpus, names of its document kinds or of the groups below, e.g. the
default A = reasoning (arithmetic and assignment documents) against B = story; for any source, glob
patterns of text files (options a_files, b_files) read as data/sources/text_files.py reads them.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from midas_jax import fs
from midas_jax.checkpoint import available_steps, is_params_export, load_model
from midas_jax.data.sources import corpus
from midas_jax.data.sources.text_files import read_documents
from midas_jax.errors import ConfigError, require
from midas_jax.evals import figures
from midas_jax.evals.embeddings import pick_steps
from midas_jax.model import Decoder
from midas_jax.padding import round_up

KIND_GROUPS: Dict[str, Tuple[str, ...]] = {
    "reasoning": ("arithmetic", "assignment"),
    "memory": ("facts",),
    "facts": ("facts",), "story": ("story",), "arithmetic": ("arithmetic",), "assignment": ("assignment",),
    "copy": ("copy",),
}
DEFAULT_A, DEFAULT_B = "reasoning", "story"
MAX_DOCUMENTS = 64
BATCH_ROWS = 16


def kinds_of(name: str, setting: str) -> Tuple[str, ...]:
  """The corpus kinds a name stands for: a group of KIND_GROUPS, or kinds joined by '+' or ','."""
  if name in KIND_GROUPS:
    return KIND_GROUPS[name]
  kinds = tuple(k.strip() for k in name.replace("+", ",").split(",") if k.strip())
  known = tuple(k for k, _ in corpus.KIND_SHARES)
  require(bool(kinds) and all(k in known for k in kinds), setting, f"unknown document kind(s) {name!r}",
          f"use a group ({', '.join(KIND_GROUPS)}) or kinds joined by '+' ({', '.join(known)})")
  return kinds


def builtin_documents(kinds: Sequence[str], seed: int, limit: int) -> List[str]:
  """The first `limit` validation documents of the built-in corpus whose kind is in `kinds`."""
  return [d.text for d in corpus.documents("validation", seed) if d.kind in kinds][:limit]


def loss_rows(token_docs: Sequence[np.ndarray], seq_len: int) -> Dict[str, np.ndarray]:
  """Causal-LM rows of every document (tokens with eos): inputs ids[:-1], targets ids[1:], cut into
  rows of seq_len; each row is its own segment starting at position 0, padding has segment id 0."""
  inputs, targets, weights = [], [], []
  for ids in token_docs:
    ids = np.asarray(ids, np.int32)
    for start in range(0, len(ids) - 1, seq_len):
      x, y = ids[start:start + seq_len], ids[start + 1:start + seq_len + 1]
      n = len(y)
      pad = seq_len - n
      inputs.append(np.pad(x[:n], (0, pad)))
      targets.append(np.pad(y, (0, pad)))
      weights.append(np.pad(np.ones(n, np.float32), (0, pad)))
  require(len(inputs) > 0, "documents", "no document has two tokens", "pick data sets with real documents")
  inputs, targets, weights = np.stack(inputs), np.stack(targets), np.stack(weights)
  return {"inputs": inputs, "targets": targets, "loss_weights": weights,
          "segment_ids": (weights > 0).astype(np.int32),
          "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), inputs.shape).copy(),
          "prefix_mask": np.zeros(inputs.shape, bool)}


_LOSS_FNS: Dict[object, object] = {}


def _loss_sums_fn(model_config):
  """jit(params, batch) -> (sum of token losses, token count), one per model config (depth)."""
  if model_config not in _LOSS_FNS:
    model = Decoder(model_config)

    @jax.jit
    def sums(params, batch):
      logits = model.apply({"params": params}, batch)
      lse = jax.nn.logsumexp(logits, axis=-1)
      target = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
      w = batch["loss_weights"]
      return ((lse - target) * w).sum(), w.sum()

    _LOSS_FNS[model_config] = sums
  return _LOSS_FNS[model_config]


def mean_loss(params, model_config, rows: Dict[str, np.ndarray], batch_rows: int = BATCH_ROWS) -> float:
  """Mean causal-LM loss per target token over `rows` (padded to whole batches with weight 0)."""
  fn = _loss_sums_fn(model_config)
  n = rows["inputs"].shape[0]
  total = round_up(n, batch_rows)
  padded = {k: np.concatenate([v, np.zeros((total - n,) + v.shape[1:], v.dtype)]) for k, v in rows.items()}
  loss, count = 0.0, 0.0
  for start in range(0, total, batch_rows):
    s, c = fn(params, {k: v[start:start + batch_rows] for k, v in padded.items()})
    loss, count = loss + float(s), count + float(c)
  return loss / max(count, 1e-9)


def delta_l(loss_a: float, loss_b: float) -> float:
  """(L_A - L_B) / L_B."""
  return (loss_a - loss_b) / loss_b


def _data_sets(model, options: dict) -> Tuple[Dict[str, str], List[str], List[str]]:
  """(descriptions, A's documents, B's documents) from the options (see the module docstring)."""
  limit = int(options.get("max_documents") or MAX_DOCUMENTS)
  files = {k: options.get(f"{k}_files") for k in ("a", "b")}
  if files["a"] or files["b"]:
    require(bool(files["a"] and files["b"]), "a_files", "only one of a_files, b_files is set",
            "give both data sets as glob patterns of text files")
    docs = {k: read_documents(files[k] if isinstance(files[k], (list, tuple)) else [files[k]], f"{k}_files",
                              model.config.data.jsonl_field)[:limit] for k in files}
    return {"a": str(files["a"]), "b": str(files["b"])}, docs["a"], docs["b"]
  names = {k: str(options.get(k) or default) for k, default in (("a", DEFAULT_A), ("b", DEFAULT_B))}
  kinds = {k: kinds_of(names[k], k) for k in names}
  seed = model.config.data.corpus_seed
  desc = {k: f"{names[k]} ({'+'.join(kinds[k])}, built-in validation)" for k in names}
  return desc, builtin_documents(kinds["a"], seed, limit), builtin_documents(kinds["b"], seed, limit)


def applies(model, options: dict):
  """The built-in corpus names A and B; any other source needs a_files and b_files."""
  if model.config.data.source != "builtin" and not (options.get("a_files") and options.get("b_files")):
    return (f"the run reads DataConfig.source={model.config.data.source!r}, not the built-in corpus: "
            "name the two data sets with the options a_files and b_files")
  return None


def _plot(steps, loss_a, loss_b, deltas, names, path) -> None:
  plt = figures.pyplot()
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
  left.plot(steps, loss_a, "o-", label=f"A: {names['a']}")
  left.plot(steps, loss_b, "s-", label=f"B: {names['b']}")
  left.set_xlabel("step")
  left.set_ylabel("held-out loss per token")
  left.legend(fontsize=7)
  right.plot(steps, deltas, "o-", color="k")
  right.axhline(0, color="gray", lw=0.8)
  right.set_xlabel("step")
  right.set_ylabel("Delta L = (L_A - L_B) / L_B")
  fig.tight_layout()
  fs.write_figure(path, fig, dpi=100)
  plt.close(fig)


def run_suite(model, workdir: str, out_dir: str, options: dict) -> dict:
  """L_A, L_B and Delta L at every kept checkpoint (at most max_checkpoints, default all), delta_l.png."""
  reason = applies(model, options)
  if reason:
    raise ConfigError("a_files", reason, "pass a_files and b_files, or evaluate a run on the built-in corpus")
  fs.makedirs(out_dir)
  names, docs_a, docs_b = _data_sets(model, options)
  require(bool(docs_a) and bool(docs_b), "a" if not docs_a else "b", "the data set has no documents",
          "choose kinds or files that hold held-out documents")
  vocab = model.vocab
  seq_len = model.config.data.seq_len
  rows = {k: loss_rows([np.asarray(vocab.encode(t) + [vocab.eos_id]) for t in docs], seq_len)
          for k, docs in (("a", docs_a), ("b", docs_b))}
  steps = [] if is_params_export(fs.absolute(workdir, "--workdir")) else available_steps(workdir)
  most = options.get("max_checkpoints")
  steps = pick_steps(steps, int(most)) if most else steps
  steps = steps or [model.step]
  series = {"steps": [], "stages": [], "loss_a": [], "loss_b": [], "delta_l": []}
  for step in steps:
    loaded = model if step == model.step else load_model(workdir, step=step)
    la = mean_loss(loaded.params, loaded.model_config, rows["a"])
    lb = mean_loss(loaded.params, loaded.model_config, rows["b"])
    for key, value in (("steps", step), ("stages", loaded.stage), ("loss_a", round(la, 5)),
                       ("loss_b", round(lb, 5)), ("delta_l", round(delta_l(la, lb), 5))):
      series[key].append(value)
  _plot(series["steps"], series["loss_a"], series["loss_b"], series["delta_l"], names,
        fs.join(out_dir, "delta_l.png"))
  return dict(series, a=names["a"], b=names["b"], documents={"a": len(docs_a), "b": len(docs_b)},
              tokens={k: int(rows[k]["loss_weights"].sum()) for k in rows}, plots=["delta_l.png"])
