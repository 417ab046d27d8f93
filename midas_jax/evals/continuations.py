"""The one scorer of (context, continuation) rows: teacher-forced causal passes read at the continuation.

A row's tokens are context + continuation; each continuation token is predicted from the true prefix.
Two readings of the same passes:

  logprobs  the log-softmax over the vocabulary predicting each continuation token, then the token
            after the continuation: the `primitive_scores` suite weighs candidates that share a row
            and reads whether the line ends after the answer (primitive_scores.py)
  totals    the sum of the continuation's token log-probabilities (float64 on the host) and whether
            every token is the argmax: lm_eval's loglikelihood requests (lm_eval_adapter.py)

The model reads a row without its last token unless the prediction after it is read (`logprobs`).
Rows are sorted longest first (a memory error comes at once), in batches of `batch_size` (a short
batch padded with dummy rows, no wider than the work), each padded to a power of two of at least
MIN_WIDTH tokens, at most max_length, so a whole evaluation compiles a handful of programs.
Log-probabilities are computed in float32 on the device.

Rows longer than max_length: `logprobs` refuses them (the suite builds prompts that fit), `totals`
drops their oldest context tokens, as lm_eval's own models do.
"""

from __future__ import annotations

import functools
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from midas_jax.configs import ModelConfig
from midas_jax.model import Decoder

MIN_WIDTH = 32
DEFAULT_BATCH_SIZE = 32
Row = Tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)


def causal_rows(tokens: jax.Array, lengths: jax.Array) -> Dict[str, jax.Array]:
  """A model batch of one causal sequence per row: tokens [B, L], the first lengths[b] of row b real."""
  b, length = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
  return {"inputs": tokens, "positions": pos, "segment_ids": (pos < lengths[:, None]).astype(jnp.int32),
          "prefix_mask": jnp.zeros((b, length), jnp.bool_)}


def bucket_width(n: int, max_length: int) -> int:
  """The padded width of a batch whose longest row has n tokens: a power of two >= MIN_WIDTH, at most max_length."""
  width = MIN_WIDTH
  while width < n:
    width *= 2
  return min(width, max_length)


def _pad(seqs: Sequence[Sequence[int]], chunk: Sequence[int], shape: Tuple[int, int]) -> np.ndarray:
  out = np.zeros(shape, np.int32)
  for r, i in enumerate(chunk):
    out[r, :len(seqs[i])] = seqs[i]
  return out


def _batches(fed: Sequence[Sequence[int]], max_length: int,
             batch_size: int) -> Iterator[Tuple[List[int], np.ndarray, np.ndarray]]:
  """(row indices, tokens [R, W], lengths [R]) per batch of the rows the model reads."""
  width_rows = min(batch_size, 1 << (len(fed) - 1).bit_length())  # no wider than the work
  order = sorted(range(len(fed)), key=lambda i: -len(fed[i]))  # longest first: a memory error comes at once
  for start in range(0, len(order), width_rows):
    chunk = order[start:start + width_rows]
    tokens = _pad(fed, chunk, (width_rows, bucket_width(max(len(fed[i]) for i in chunk), max_length)))
    lengths = np.ones((width_rows,), np.int32)  # dummy rows: one pad token
    lengths[:len(chunk)] = [len(fed[i]) for i in chunk]
    yield chunk, tokens, lengths


@functools.lru_cache(maxsize=16)
def _logprobs_fn(cfg: ModelConfig, positions: int):
  """jit(params, tokens [B, W], lengths [B], first [B]) -> log-softmax [B, positions, V] at first-1, first, ..."""
  model = Decoder(cfg)

  def fn(params, tokens, lengths, first):
    width = tokens.shape[1]
    logits = model.apply({"params": params}, causal_rows(tokens, lengths)).astype(jnp.float32)
    at = jnp.clip(first[:, None] - 1 + jnp.arange(positions)[None, :], 0, width - 1)
    picked = jnp.take_along_axis(logits, at[:, :, None], axis=1)
    return jax.nn.log_softmax(picked, axis=-1)

  return jax.jit(fn)


def logprobs(params, cfg: ModelConfig, rows: Sequence[Row], max_length: int,
             batch_size: int = DEFAULT_BATCH_SIZE) -> List[np.ndarray]:
  """For each row: the log-softmax [len(continuation) + 1, vocab] that predicts each continuation token
  from the true prefix, then the token after the continuation. Rows need a context and at most
  max_length tokens in all."""
  if not rows:
    return []
  longest = max(len(c) + len(t) for c, t in rows)
  if min(len(c) for c, _ in rows) < 1 or longest > max_length:
    raise ValueError(f"rows must have a context and at most {max_length} tokens in all; the longest has {longest}")
  fn = _logprobs_fn(cfg, max(len(t) for _, t in rows) + 1)
  params = jax.device_put(params)
  fed = [list(c) + list(t) for c, t in rows]
  out: List[Optional[np.ndarray]] = [None] * len(rows)
  for chunk, tokens, lengths in _batches(fed, max_length, batch_size):
    first = np.ones_like(lengths)
    first[:len(chunk)] = [len(rows[i][0]) for i in chunk]
    logp = np.asarray(fn(params, tokens, lengths, first))
    for r, i in enumerate(chunk):
      out[i] = logp[r, :len(rows[i][1]) + 1]
  return out  # type: ignore[return-value]


@functools.lru_cache(maxsize=16)
def _totals_fn(cfg: ModelConfig):
  """jit(params, inputs [B, W], targets [B, W], lengths [B]) -> (log p(target) [B, W], target is the argmax [B, W])."""
  model = Decoder(cfg)

  def fn(params, inputs, targets, lengths):
    logits = model.apply({"params": params}, causal_rows(inputs, lengths)).astype(jnp.float32)
    # logsumexp rather than log_softmax: one [B, W, V] buffer, not two.
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logp = picked - jax.nn.logsumexp(logits, axis=-1)
    return logp, jnp.argmax(logits, axis=-1) == targets

  return jax.jit(fn)


def totals(params, cfg: ModelConfig, rows: Sequence[Row], max_length: int,
           batch_size: int = DEFAULT_BATCH_SIZE) -> List[Tuple[float, bool]]:
  """For each row: (sum of the continuation's log-probs, whether every continuation token is the argmax
  given the true prefix). The context needs a token; context + continuation beyond max_length + 1
  tokens drops the oldest context tokens."""
  if not rows:
    return []
  for ctx, cont in rows:
    if not ctx or not cont or len(cont) > max_length:
      raise ValueError(f"a row needs a context and 1 to {max_length} continuation tokens; got {len(ctx)} and "
                       f"{len(cont)}")
  fn = _totals_fn(cfg)
  params = jax.device_put(params)
  # A row as the model sees it: the last max_length + 1 tokens, shifted by one.
  whole = [(list(ctx) + list(cont))[-(max_length + 1):] for ctx, cont in rows]
  fed, targets = [ids[:-1] for ids in whole], [ids[1:] for ids in whole]
  out: List[Tuple[float, bool]] = [(0.0, False)] * len(rows)
  for chunk, tokens, lengths in _batches(fed, max_length, batch_size):
    logp, greedy = (np.asarray(a) for a in fn(params, tokens, _pad(targets, chunk, tokens.shape), lengths))
    for r, i in enumerate(chunk):
      n, scored = len(fed[i]), len(rows[i][1])
      out[i] = (float(np.sum(logp[r, n - scored:n], dtype=np.float64)), bool(np.all(greedy[r, n - scored:n])))
  return out
