"""Parameter and FLOP counts from configs, checked against hand arithmetic."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from midas_jax.analysis.dot_dtypes import stablehlo_dots
from midas_jax.configs import ModelConfig
from midas_jax.errors import ConfigError
from midas_jax.flops import (forward_flops_per_token, layer_applications, matmul_params, param_counts,
                             train_flops_per_token)
from midas_jax.model import Decoder, dummy_batch
from midas_jax.stacking import schedule as sched

GPT2_SMALL = ModelConfig(family="gpt2", vocab_size=50257, d_model=768, num_layers=12, num_heads=12,
                         d_ff=3072, max_seq_len=1024)
# Small llama with GQA and an untied head: d 64, 4 query heads and 2 kv heads of 16, d_ff 160.
LLAMA = ModelConfig(family="llama", vocab_size=256, d_model=64, num_layers=3, num_heads=4,
                    num_kv_heads=2, d_ff=160, max_seq_len=128, tie_embeddings=False)


def test_gpt2_small_is_124m():
  c = param_counts(GPT2_SMALL)
  assert c["total"] == 124_439_808
  assert c["embedding"] == 50257 * 768 and c["position_embedding"] == 1024 * 768
  assert c["attention_per_layer"] == 4 * 768 * 768 + 4 * 768
  assert c["mlp_per_layer"] == 2 * 768 * 3072 + 3072 + 768
  assert c["norms"] == 12 * 4 * 768 + 2 * 768 and c["head"] == 0
  assert c["non_embedding"] == 124_439_808 - 50257 * 768 - 1024 * 768  # 85,056,000


def test_llama_gqa_by_hand():
  c = param_counts(LLAMA)
  attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k, v (2 kv heads x 16), o
  mlp = 3 * 64 * 160
  assert c["attention_per_layer"] == attention == 12288
  assert c["mlp_per_layer"] == mlp == 30720
  assert c["norms_per_layer"] == 128 and c["final_norm"] == 64 and c["position_embedding"] == 0
  assert c["head"] == 256 * 64
  total = 256 * 64 + 3 * (attention + mlp + 128) + 64 + 256 * 64
  assert c["total"] == total == 162_240
  assert c["non_embedding"] == total - 256 * 64
  tied = param_counts(dataclasses.replace(LLAMA, tie_embeddings=True))
  assert tied["head"] == 0 and tied["total"] == total - 256 * 64
  assert tied["non_embedding"] == total - 2 * 256 * 64
  biased = param_counts(dataclasses.replace(LLAMA, qkv_bias=True))  # Qwen2: biases on q, k and v only
  assert biased["attention_per_layer"] == attention + 64 + 2 * 32 and biased["mlp_per_layer"] == mlp


def test_num_layers_override_and_missing_vocab():
  assert param_counts(LLAMA, num_layers=6)["total"] - param_counts(LLAMA)["total"] == \
      3 * param_counts(LLAMA)["per_layer"]
  with pytest.raises(ConfigError, match="with_vocab"):
    param_counts(ModelConfig(vocab_size=None))


def test_train_flops_by_hand():
  seq = 1024
  n = 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 768 * 50257  # tied head still multiplies
  assert matmul_params(GPT2_SMALL) == n
  assert train_flops_per_token(GPT2_SMALL, seq) == 6 * n + 6 * 12 * seq * 12 * 64
  assert forward_flops_per_token(GPT2_SMALL, seq) == pytest.approx(train_flops_per_token(GPT2_SMALL, seq) / 3)
  # GQA shrinks k and v, but attention scores are still over all query heads.
  llama_n = 3 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 160) + 64 * 256
  assert train_flops_per_token(LLAMA, 128) == 6 * llama_n + 6 * 3 * 128 * 4 * 16


def test_train_flops_scaling():
  f = lambda seq, layers=None: train_flops_per_token(LLAMA, seq, num_layers=layers)
  # Linear in sequence length with slope 6 * L * H * hd (the causal triangle); the parameter part does not depend on it.
  assert f(256) - f(128) == pytest.approx(6 * 3 * 128 * 64)
  assert f(128) - 6 * 3 * 128 * 64 == pytest.approx(6 * matmul_params(LLAMA))
  # Each layer adds the same amount; the head's cost is paid once.
  per_layer = f(128, 4) - f(128, 3)
  assert f(128, 9) - f(128, 3) == pytest.approx(6 * per_layer)
  assert f(128, 3) == f(128)
  assert f(128, 3) - 3 * per_layer == pytest.approx(6 * 64 * 256)
  # Long-context check: at short length 6N dominates; at seq = 6N/(6 L H hd) attention equals it.
  seq_equal = 6 * matmul_params(LLAMA) / (6 * 3 * 4 * 16)
  assert f(int(seq_equal)) == pytest.approx(2 * 6 * matmul_params(LLAMA), rel=1e-3)


# The looping test's model (tests/test_looping.py) at vocab 512: d 32, 4 query heads and 2 kv heads
# of 8, d_ff 64, trained on rows of 32 tokens.
TINY = ModelConfig(family="llama", vocab_size=512, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
                   d_ff=64, max_seq_len=128)
TINY_LAYER = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64  # q, o; k, v; gate, up, down: 9216 weights
TINY_ATTENTION = 32 * 4 * 8  # QK^T and AV per token per layer at seq 32, the causal half: 2 x 16 keys x 4 heads x 8
TINY_HEAD = 32 * 512


def test_a_looped_block_counts_every_application():
  looped = dataclasses.replace(TINY, loop_start=1, loop_size=1, loop_repeats=2)  # layers 0, 1, 1, 2
  by_hand = 6 * (4 * (TINY_LAYER + TINY_ATTENTION) + TINY_HEAD)
  assert by_hand == 344_064
  assert layer_applications(looped) == 4
  assert train_flops_per_token(looped, 32) == by_hand
  # The stored depth given explicitly (as the train loop and the stage schedule do) counts the same.
  assert train_flops_per_token(looped, 32, num_layers=3) == by_hand
  assert param_counts(looped) == param_counts(TINY)  # the loop ties weights: nothing more is stored


def test_a_grown_then_looped_model_counts_the_loop_at_every_depth():
  # Grown from 2 to 4 layers with layer 1 applied twice throughout: 3, then 5 applications.
  looped = dataclasses.replace(TINY, num_layers=4, loop_start=1, loop_size=1, loop_repeats=2)
  depth_2, depth_4 = (6 * (n * (TINY_LAYER + TINY_ATTENTION) + TINY_HEAD) for n in (3, 5))
  assert (depth_2, depth_4) == (282_624, 405_504)
  assert train_flops_per_token(looped, 32, num_layers=2) == depth_2
  assert train_flops_per_token(looped, 32, num_layers=4) == depth_4
  schedule = sched.StageSchedule((3, 5), 2)
  tokens = 8 * 32
  assert sched.cumulative_flops(looped, 32, tokens, schedule, 4) == tokens * (3 * depth_2 + depth_4)
  assert sched.flop_speedup(looped, 32, schedule) == pytest.approx(8 * depth_4 / (3 * depth_2 + 5 * depth_4))


def test_train_flops_match_the_matmuls_of_the_lowered_train_step():
  """flops.py against every dot_general of a lowered gradient step of a one-layer float32 model.

  One layer: the reader counts a dot inside the scanned stack once, which is then exactly once per
  step. No remat, so nothing is recomputed: the program's backward is two matmuls per forward one,
  the 2 + 4 of the 6-per-weight convention. The one difference by convention: dense attention
  computes the whole T x T score matrix, flops.py counts the causal triangle (T / 2 keys per query).
  """
  # d 48, 4 query heads of 12, 2 kv heads, d_ff 80, vocab 256, untied head; no size equals T = 32,
  # so a matmul with two T-sized dimensions in its operands or result is one of attention's.
  cfg = ModelConfig(family="llama", vocab_size=256, d_model=48, num_layers=1, num_heads=4, num_kv_heads=2,
                    d_ff=80, max_seq_len=64, dtype="float32", attention="dot_product", tie_embeddings=False)
  rows, seq = 2, 32
  model, batch = Decoder(cfg), dummy_batch(rows, seq)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), batch)

  def loss(p, b):
    logp = jax.nn.log_softmax(model.apply(p, b))
    return -jnp.take_along_axis(logp, b["targets"][..., None], axis=-1).mean()

  dots = stablehlo_dots(jax.jit(jax.grad(loss)).lower(params, batch).as_text())
  assert len(dots) == 3 * (7 + 2 + 1)  # q k v o, gate up down; QK^T, AV; the head: each forward and 2 backward
  is_attention = lambda d: any(t.split("x").count(str(seq)) >= 2 for t in re.findall(r"tensor<([^>]*)>", d.text))
  assert sum(map(is_attention, dots)) == 3 * 2
  attention = sum(d.flops for d in dots if is_attention(d)) / (rows * seq)
  weights = sum(d.flops for d in dots if not is_attention(d)) / (rows * seq)
  # Per token, by hand: 6 FLOPs per matmul weight (q 48x48, k and v 48x24, o 48x48; gate, up, down 48x80;
  # head 48x256) ...
  n = 2 * 48 * 48 + 2 * 48 * 24 + 3 * 48 * 80 + 48 * 256
  assert weights == 6 * n == 6 * matmul_params(cfg) == 184_320
  # ... and QK^T and AV over every one of the 32 keys (the dense square) for 4 heads of 12, x 6 for
  # the forward and backward: twice flops.py's causal triangle.
  dense_attention = 6 * 2 * seq * 4 * 12
  assert attention == dense_attention == 18_432
  causal = train_flops_per_token(cfg, seq) - 6 * matmul_params(cfg)
  assert attention == 2 * causal, "the dense score matrix is twice the causal triangle flops.py counts"
  assert train_flops_per_token(cfg, seq) == weights + attention / 2 == 193_536
  assert forward_flops_per_token(cfg, seq) == pytest.approx((weights + attention / 2) / 3, rel=1e-12)
