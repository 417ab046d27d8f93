"""Batched generation with our Decoder: greedy or sampled, with a key/value cache.

The prompt is run once and every new token costs one position (model/kv_cache.py); `cache=False`
recomputes the whole sequence for every token instead, the reference the cache is tested against.
Each prompt has its own budget of new tokens (its answer's length plus a period, a space and the end
of line), and rows stop at their budget or at a stop token (end of line, EOS). A prompt may have a
bidirectional prefix (`prefix_lengths`): its first tokens attend to each other as the inputs of a
prefix-LM or span-corruption example did in training; the eval suites decode causally (no prefix).

Shapes are fixed per call: prompts are sorted by budget and length and decoded in batches of
`batch_size` rows (a short batch padded with dummy rows), each padded to a multiple of
LENGTH_BUCKET tokens, with the budget rounded up to a multiple of BUDGET_BUCKET, so a whole eval
compiles a handful of programs. The token loop is one jitted `lax.while_loop` that ends as soon as
every row of the batch is done.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from midas_jax.configs import ModelConfig
from midas_jax.model import Decoder, kv_cache
from midas_jax.padding import round_up

LENGTH_BUCKET = 64
BUDGET_BUCKET = 8


class Completion(NamedTuple):
  """What the model wrote after a prompt: `text` includes the stop token's text; `ended` says one came."""

  text: str
  ids: Tuple[int, ...]
  ended: bool


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen: temperature 0 is greedy (argmax); otherwise a draw from the
  softmax of logits / temperature, over the top_k most likely tokens only when top_k > 0."""

  temperature: float = 0.0
  top_k: int = 0
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0 or self.top_k < 0:
      raise ValueError(f"need temperature >= 0 and top_k >= 0, got {self.temperature}, {self.top_k}")


GREEDY = Sampling()


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


def _pick(logits: jax.Array, i, sampling: Sampling, seed) -> jax.Array:
  """The next token of every row from its logits [batch, vocab] at generation step i."""
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits / sampling.temperature
  if sampling.top_k:
    kth = jax.lax.top_k(scaled, sampling.top_k)[0][:, -1:]
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
  key = jax.random.fold_in(jax.random.key(seed), i)
  return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


class _Rows(NamedTuple):
  """The loop state both decoders share: what each row has emitted and whether it is done."""

  i: jax.Array          # generation step
  lengths: jax.Array    # [batch] tokens in the row's context
  done: jax.Array       # [batch] bool
  out: jax.Array        # [batch, max_new_tokens] emitted ids, -1 after the end


def _emit(rows: _Rows, nxt, width: int, budgets, stop_ids) -> Tuple[_Rows, jax.Array, jax.Array]:
  """Records each running row's token; returns the new state, where it goes and whether it fits."""
  emit = ~rows.done
  out = rows.out.at[:, rows.i].set(jnp.where(emit, nxt, -1))
  room = emit & (rows.lengths < width)
  at = jnp.minimum(rows.lengths, width - 1)
  lengths = rows.lengths + room.astype(jnp.int32)
  done = rows.done | (emit & jnp.isin(nxt, stop_ids)) | (lengths >= width) | (rows.i + 1 >= budgets)
  return _Rows(rows.i + 1, lengths, done, out), at, room


def _start(batch_size: int, max_new_tokens: int, lengths) -> _Rows:
  return _Rows(jnp.int32(0), lengths, jnp.zeros((batch_size,), jnp.bool_),
               jnp.full((batch_size, max_new_tokens), -1, jnp.int32))


def _running(rows: _Rows, max_new_tokens: int):
  return (rows.i < max_new_tokens) & ~jnp.all(rows.done)


@functools.lru_cache(maxsize=32)
def _cached_fn(cfg: ModelConfig, max_new_tokens: int, sampling: Sampling):
  """The decoder with a key/value cache: one prefill, then one position per token."""

  def decode(params, tokens, lengths, prefix_lengths, budgets, stop_ids, seed):
    batch_size, width = tokens.shape
    logits, cache = kv_cache.prefill(params, cfg, tokens, lengths, prefix_lengths)

    def body(carry):
      rows, logits, cache = carry
      nxt = _pick(logits, rows.i, sampling, seed)
      rows, at, _ = _emit(rows, nxt, width, budgets, stop_ids)
      # The next step's logits, unless the loop ends here (a finished row's write is never read).
      logits, cache = jax.lax.cond(_running(rows, max_new_tokens),
                                   lambda: kv_cache.step(params, cfg, cache, nxt, at), lambda: (logits, cache))
      return rows, logits, cache

    rows = jax.lax.while_loop(lambda c: _running(c[0], max_new_tokens), body,
                              (_start(batch_size, max_new_tokens, lengths), logits, cache))[0]
    return rows.out

  return jax.jit(decode)


@functools.lru_cache(maxsize=32)
def _uncached_fn(cfg: ModelConfig, max_new_tokens: int, sampling: Sampling):
  """The reference: a full forward pass over the whole buffer for every token."""
  model = Decoder(cfg)

  def decode(params, tokens, lengths, prefix_lengths, budgets, stop_ids, seed):
    batch_size, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
    zeros = jnp.zeros_like(tokens)
    prefix_mask = positions < prefix_lengths[:, None]
    batch_rows = jnp.arange(batch_size)

    def body(carry):
      rows, tokens = carry
      batch = {"inputs": tokens, "targets": zeros, "positions": positions,
               "segment_ids": (positions < rows.lengths[:, None]).astype(jnp.int32), "prefix_mask": prefix_mask,
               "loss_weights": zeros.astype(jnp.float32), "objective_ids": zeros}
      logits = model.apply({"params": params}, batch)
      last = jnp.take_along_axis(logits, (rows.lengths - 1)[:, None, None], axis=1)[:, 0]
      nxt = _pick(last, rows.i, sampling, seed)
      rows, at, room = _emit(rows, nxt, width, budgets, stop_ids)
      tokens = tokens.at[batch_rows, at].set(jnp.where(room, nxt, tokens[batch_rows, at]))
      return rows, tokens

    rows = jax.lax.while_loop(lambda c: _running(c[0], max_new_tokens), body,
                              (_start(batch_size, max_new_tokens, lengths), tokens))[0]
    return rows.out

  return jax.jit(decode)


def generate(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], budgets: Sequence[int],
             stop_ids: Sequence[int], max_length: int, batch_size: int = 32, sampling: Sampling = GREEDY,
             prefix_lengths: Optional[Sequence[int]] = None, cache: bool = True) -> List[Tuple[List[int], bool]]:
  """For each prompt (token ids): (generated ids, stop token included if one came; whether one came).

  Prompt i generates at most budgets[i] tokens, and no more once its context holds max_length
  tokens; its first prefix_lengths[i] tokens (default 0) form a bidirectional prefix. A prompt longer
  than max_length is an error. A sampled row's draws depend on its batch and position in it, so
  change `sampling.seed` for other samples.
  """
  if not prompts:
    return []
  if len(budgets) != len(prompts) or min(budgets) < 1:
    raise ValueError(f"need one budget >= 1 per prompt; got {len(budgets)} for {len(prompts)} prompts")
  longest = max(len(p) for p in prompts)
  if min(len(p) for p in prompts) < 1 or longest > max_length:
    raise ValueError(f"prompts must have 1 to {max_length} tokens; got lengths {min(map(len, prompts))} "
                     f"to {longest}")
  prefix_lengths = [0] * len(prompts) if prefix_lengths is None else list(prefix_lengths)
  if len(prefix_lengths) != len(prompts) or any(not 0 <= n <= len(p) for n, p in zip(prefix_lengths, prompts)):
    raise ValueError("need one prefix length per prompt, each between 0 and the prompt's length")
  make = _cached_fn if cache else _uncached_fn
  # The seed is an argument of the compiled program, not part of it: other samples compile nothing.
  fn = make(cfg, round_up(max(budgets), BUDGET_BUCKET), dataclasses.replace(sampling, seed=0))
  seed = np.uint32(sampling.seed)
  params = jax.device_put(params)
  stop = np.asarray(sorted(set(stop_ids)), np.int32)
  stop = np.pad(stop, (0, max(8, 1 << len(stop).bit_length()) - len(stop)), constant_values=-1)  # few shapes
  rows = min(batch_size, 1 << (len(prompts) - 1).bit_length())  # no wider than the work
  order = sorted(range(len(prompts)), key=lambda i: (budgets[i], len(prompts[i])))
  results: List[Tuple[List[int], bool]] = [([], False)] * len(prompts)
  for start in range(0, len(order), rows):
    chunk = order[start:start + rows]
    need = max(len(prompts[i]) + budgets[i] for i in chunk)
    width = min(max_length, round_up(need, LENGTH_BUCKET))
    tokens = np.zeros((rows, width), np.int32)
    lengths = np.ones((rows,), np.int32)  # dummy rows: one pad token, one step
    row_budgets = np.ones((rows,), np.int32)
    row_prefix = np.zeros((rows,), np.int32)
    for r, i in enumerate(chunk):
      tokens[r, :len(prompts[i])] = prompts[i]
      lengths[r], row_budgets[r], row_prefix[r] = len(prompts[i]), budgets[i], prefix_lengths[i]
    out = np.asarray(fn(params, tokens, lengths, row_prefix, row_budgets, stop, seed))
    for r, i in enumerate(chunk):
      ids = [int(t) for t in out[r] if t >= 0]
      results[i] = (ids, bool(ids) and ids[-1] in stop_ids)
  return results


def greedy_decode(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], budgets: Sequence[int],
                  stop_ids: Sequence[int], max_length: int, batch_size: int = 32,
                  cache: bool = True) -> List[Tuple[List[int], bool]]:
  """Greedy `generate` of causal prompts."""
  return generate(params, cfg, prompts, budgets, stop_ids, max_length, batch_size, GREEDY, cache=cache)


def complete(params, cfg: ModelConfig, vocab, prompts: Sequence[str], budgets: Sequence[int], max_length: int,
             batch_size: int = 32, sampling: Sampling = GREEDY) -> List[Completion]:
  """Completions of text prompts (greedy by default), each up to the end of its line or its budget."""
  stop_ids = stop_token_ids(vocab)
  decoded = generate(params, cfg, [vocab.encode(p) for p in prompts], budgets, stop_ids, max_length, batch_size,
                     sampling)
  return [Completion(vocab.decode(ids), tuple(ids), ended) for ids, ended in decoded]
