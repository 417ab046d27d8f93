"""Batched greedy decoding with our Decoder: one full forward pass per generated token.

At our scale (contexts of a few hundred tokens) recomputing the whole sequence each step is cheaper
to get right than a KV cache, and fast enough when little is generated: each prompt has its own
budget of new tokens (its answer's length plus a period, a space and the end of line), and rows
stop at their budget or at a stop token (end of line, EOS). Shapes are fixed per call: prompts are
sorted by budget and length and decoded in batches of `batch_size` rows (a short batch padded with
dummy rows), each padded to a multiple of LENGTH_BUCKET tokens, with the budget rounded up to a
multiple of BUDGET_BUCKET, so a whole eval compiles a handful of programs. The token loop is one
jitted `lax.while_loop` that ends as soon as every row of the batch is done.
"""

from __future__ import annotations

import functools
from typing import List, NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from midas_jax.configs import ModelConfig
from midas_jax.model import Decoder

LENGTH_BUCKET = 64
BUDGET_BUCKET = 8


class Completion(NamedTuple):
  """What the model wrote after a prompt: `text` includes the stop token's text; `ended` says one came."""

  text: str
  ids: Tuple[int, ...]
  ended: bool


def stop_token_ids(vocab) -> Tuple[int, ...]:
  """EOS and every id whose text contains a newline: an answer is one line."""
  ids = {vocab.eos_id}
  ids.update(i for i in range(vocab.vocab_size) if "\n" in vocab.decode([i]))
  return tuple(sorted(ids))


def answer_budget(vocab, example) -> int:
  """Tokens an answer may take: its own, a period, a space and the stop token.

  A line still open after this many tokens cannot normalize to the answer (scoring.py), so the
  budget decides nothing and only bounds the work.
  """
  return len(vocab.encode(example.answer)) + 3


@functools.lru_cache(maxsize=32)
def _decode_fn(cfg: ModelConfig, max_new_tokens: int):
  model = Decoder(cfg)

  def decode(params, tokens, lengths, budgets, stop_ids):
    batch_size, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
    zeros = jnp.zeros_like(tokens)
    rows = jnp.arange(batch_size)

    def step(carry):
      i, tokens, lengths, done, out = carry
      batch = {"inputs": tokens, "targets": zeros, "positions": positions,
               "segment_ids": (positions < lengths[:, None]).astype(jnp.int32),
               "prefix_mask": jnp.zeros(tokens.shape, jnp.bool_),
               "loss_weights": zeros.astype(jnp.float32), "objective_ids": zeros}
      logits = model.apply({"params": params}, batch)
      last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
      nxt = jnp.argmax(last, axis=-1).astype(jnp.int32)
      emit = ~done
      out = out.at[:, i].set(jnp.where(emit, nxt, -1))
      room = emit & (lengths < length)
      at = jnp.minimum(lengths, length - 1)
      tokens = tokens.at[rows, at].set(jnp.where(room, nxt, tokens[rows, at]))
      lengths = lengths + room.astype(jnp.int32)
      done = done | (emit & jnp.isin(nxt, stop_ids)) | (lengths >= length) | (i + 1 >= budgets)
      return i + 1, tokens, lengths, done, out

    def running(carry):
      i, _, _, done, _ = carry
      return (i < max_new_tokens) & ~jnp.all(done)

    init = (jnp.int32(0), tokens, lengths, jnp.zeros((batch_size,), jnp.bool_),
            jnp.full((batch_size, max_new_tokens), -1, jnp.int32))
    return jax.lax.while_loop(running, step, init)[-1]

  return jax.jit(decode)


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def greedy_decode(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], budgets: Sequence[int],
                  stop_ids: Sequence[int], max_length: int, batch_size: int = 32) -> List[Tuple[List[int], bool]]:
  """For each prompt (token ids): (generated ids, stop token included if one came; whether one came).

  Prompt i generates at most budgets[i] tokens, and no more once its context holds max_length
  tokens. A prompt longer than max_length is an error.
  """
  if not prompts:
    return []
  if len(budgets) != len(prompts) or min(budgets) < 1:
    raise ValueError(f"need one budget >= 1 per prompt; got {len(budgets)} for {len(prompts)} prompts")
  longest = max(len(p) for p in prompts)
  if min(len(p) for p in prompts) < 1 or longest > max_length:
    raise ValueError(f"prompts must have 1 to {max_length} tokens; got lengths {min(map(len, prompts))} "
                     f"to {longest}")
  fn = _decode_fn(cfg, _round_up(max(budgets), BUDGET_BUCKET))
  params = jax.device_put(params)
  stop = np.asarray(sorted(set(stop_ids)), np.int32)
  rows = min(batch_size, 1 << (len(prompts) - 1).bit_length())  # no wider than the work
  order = sorted(range(len(prompts)), key=lambda i: (budgets[i], len(prompts[i])))
  results: List[Tuple[List[int], bool]] = [([], False)] * len(prompts)
  for start in range(0, len(order), rows):
    chunk = order[start:start + rows]
    need = max(len(prompts[i]) + budgets[i] for i in chunk)
    width = min(max_length, _round_up(need, LENGTH_BUCKET))
    tokens = np.zeros((rows, width), np.int32)
    lengths = np.ones((rows,), np.int32)  # dummy rows: one pad token, one step
    row_budgets = np.ones((rows,), np.int32)
    for r, i in enumerate(chunk):
      tokens[r, :len(prompts[i])] = prompts[i]
      lengths[r], row_budgets[r] = len(prompts[i]), budgets[i]
    out = np.asarray(fn(params, tokens, lengths, row_budgets, stop))
    for r, i in enumerate(chunk):
      ids = [int(t) for t in out[r] if t >= 0]
      results[i] = (ids, bool(ids) and ids[-1] in stop_ids)
  return results


def complete(params, cfg: ModelConfig, vocab, prompts: Sequence[str], budgets: Sequence[int], max_length: int,
             batch_size: int = 32) -> List[Completion]:
  """Greedy completions of text prompts, each up to the end of its line or its budget of tokens."""
  stop_ids = stop_token_ids(vocab)
  decoded = greedy_decode(params, cfg, [vocab.encode(p) for p in prompts], budgets, stop_ids, max_length,
                          batch_size)
  return [Completion(vocab.decode(ids), tuple(ids), ended) for ids, ended in decoded]
