"""Decoding with a key/value cache: the same tokens as a full forward pass per token, and the same
logits as the training mask gives (a bidirectional prefix included), for every model layout."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from midas_jax import configs
from midas_jax.evals import decoding
from midas_jax.model import Decoder, dummy_batch, kv_cache

# Between them: rotary and learned positions, GQA, q/k/v biases, a looped block, bfloat16 compute.
LAYOUTS = {
    "llama_gqa_biases_looped_bf16": dict(family="llama", num_kv_heads=2, qkv_bias=True, loop_start=1, loop_size=1,
                                         loop_repeats=2, dtype="bfloat16"),
    "gpt2": dict(family="gpt2"),
}


@functools.lru_cache(maxsize=None)
def _model(items):
  return _build(**dict(items))


def model(**kw):
  """(config, parameters) of a small model, built once per layout."""
  return _model(tuple(sorted(kw.items())))


def _build(**kw):
  cfg = configs.ModelConfig(**{**dict(d_model=32, num_layers=3, num_heads=4, d_ff=64, max_seq_len=128, vocab_size=300,
                                      dtype="float32", init_std=0.3), **kw})
  plain = configs.ModelConfig(**{**cfg.__dict__, "loop_start": 0, "loop_size": 0, "loop_repeats": 1})
  params = nn.unbox(jax.jit(Decoder(plain).init)(jax.random.key(0), dummy_batch(1, 8))["params"])
  rng = np.random.default_rng(1)  # biases and norm scales off their initial 0 and 1
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + rng.normal(0, 0.3, x.shape).astype(np.float32) if "bias" in str(p[-1]) or "scale" in str(p[-1])
      else x, params)
  return cfg, params


PROMPTS = [list(np.random.default_rng(2).integers(3, 300, n)) for n in (5, 17, 3, 40, 9)]
BUDGETS = [12, 5, 20, 8, 16]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cached_decoding_gives_the_uncached_tokens(layout):
  cfg, params = model(**LAYOUTS[layout])
  free = decoding.generate(params, cfg, PROMPTS, BUDGETS, [], 64, batch_size=4)
  stop = [free[0][0][3], free[3][0][1]]  # tokens the model does write: rows end on them
  prefix = [3, 10, 0, 20, 9]
  for kwargs in (dict(), dict(prefix_lengths=prefix)):
    reference = decoding.generate(params, cfg, PROMPTS, BUDGETS, stop, 64, 4, cache=False, **kwargs)
    assert decoding.generate(params, cfg, PROMPTS, BUDGETS, stop, 64, 4, **kwargs) == reference
    assert any(ended for _, ended in reference)  # stopping is exercised
  assert decoding.generate(params, cfg, PROMPTS, BUDGETS, stop, 64, 4, prefix_lengths=prefix) != \
      decoding.generate(params, cfg, PROMPTS, BUDGETS, stop, 64, 4)  # the prefix changes what is written


def test_sampled_decoding_matches_too():
  cfg, params = model(**LAYOUTS["gpt2"])
  sampling = decoding.Sampling(temperature=0.8, top_k=20, seed=3)
  sampled = decoding.generate(params, cfg, PROMPTS, BUDGETS, [], 64, 4, sampling)
  assert sampled == decoding.generate(params, cfg, PROMPTS, BUDGETS, [], 64, 4, sampling, cache=False)
  other = decoding.generate(params, cfg, PROMPTS, BUDGETS, [], 64, 4, decoding.Sampling(0.8, 20, seed=4))
  assert other != sampled  # the seed decides the draws (and is no part of the compiled program)


def test_cache_logits_equal_the_training_mask():
  """Prefill and each step give the logits a full forward pass over the grown sequence gives."""
  cfg, params = model(family="llama", num_kv_heads=2)
  width, length, prefix = 16, 6, 4
  tokens = np.random.default_rng(3).integers(3, 300, (2, width)).astype(np.int32)
  lengths, prefixes = np.array([length, length - 2], np.int32), np.array([prefix, 0], np.int32)
  positions = np.broadcast_to(np.arange(width), (2, width))

  @jax.jit
  def full(tokens, valid):  # the training mask: one segment per row, its first tokens a prefix
    batch = dict(dummy_batch(2, width), inputs=tokens, segment_ids=(positions < valid[:, None]).astype(jnp.int32),
                 prefix_mask=positions < prefixes[:, None])
    return Decoder(cfg).apply({"params": params}, batch)[jnp.arange(2), valid - 1]

  # The cached side runs the prefill through the flash kernel (interpreted here), as 'auto' does on
  # TPU and GPU; a decoding step attends densely (model/attention.py).
  fused = dataclasses.replace(cfg, attention="flash")
  logits, cache = jax.jit(lambda *a: kv_cache.prefill(params, fused, *a))(tokens, lengths, prefixes)
  step = jax.jit(lambda cache, nxt, at: kv_cache.step(params, fused, cache, nxt, at))
  for i in range(3):
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full(tokens, lengths + i)), atol=2e-5)
    nxt = np.asarray(logits).argmax(-1).astype(np.int32)
    tokens[np.arange(2), lengths + i] = nxt
    logits, cache = step(cache, nxt, lengths + i)
