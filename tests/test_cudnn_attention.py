"""The cuDNN attention path (model/kernels/cudnn.py): what 'auto' picks on a GPU, the errors before any
compile where cuDNN cannot run, and the call itself, made through XLA here (no GPU), against the dense path.

cuDNN's kernel itself runs only on an NVIDIA GPU; this machine has none, so its numbers are not checked
here. What is checked is everything around it: the layout, the GQA heads and the mask it is handed.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO_ROOT, ul2_rows
from midas_jax import configs
from midas_jax.bench import compile_bench
from midas_jax.commands.common import load_run_config
from midas_jax.errors import ConfigError
from midas_jax.model import Decoder, attention, describe_mask
from midas_jax.model.kernels import cudnn


def test_auto_takes_cudnn_on_gpu_where_it_applies_and_dense_where_not():
  assert attention.resolve("auto", "gpu", "bfloat16", 64) == "cudnn"
  assert attention.resolve("auto", "gpu", "bfloat16", 256) == "dot_product"  # above 128 before Hopper
  assert attention.resolve("auto", "gpu", "bfloat16", 60) == "dot_product"  # not a multiple of 8
  assert attention.resolve("auto", "gpu", "float32", 64) == "dot_product"  # cuDNN's kernel is 16-bit only
  assert attention.resolve("auto", "rocm", "bfloat16", 64) == "dot_product"
  assert attention.resolve("auto", "tpu", "bfloat16", 64) == "flash"
  assert attention.resolve("auto", "cpu", "bfloat16", 64) == "dot_product"
  model = Decoder(configs.ModelConfig(d_model=256, num_heads=4, vocab_size=256), platform="gpu")
  assert model.attention_implementation == "cudnn"


def test_cudnn_where_it_cannot_run_is_refused_naming_the_setting():
  with pytest.raises(ConfigError, match="ModelConfig.attention.*NVIDIA GPU"):
    attention.resolve("cudnn", "tpu", "bfloat16", 64)
  with pytest.raises(ConfigError, match="ModelConfig.attention.*bfloat16 or float16"):
    attention.resolve("cudnn", "gpu", "float32", 64)
  with pytest.raises(ConfigError, match="ModelConfig.attention.*multiple of 8"):
    Decoder(configs.ModelConfig(d_model=240, num_heads=4, vocab_size=256, attention="cudnn"),
            platform="gpu").attention_implementation


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_cudnn_call_through_xla_is_the_dense_path_on_packed_ul2_rows(kv_heads):
  batch = ul2_rows(seed=3, num_rows=2, seq_len=64)
  mask = describe_mask(jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["positions"]),
                       jnp.asarray(batch["prefix_mask"]))
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (2, 64, 4, 16), jnp.float32)
  k = jax.random.normal(kk, (2, 64, kv_heads, 16), jnp.float32)
  v = jax.random.normal(kv, (2, 64, kv_heads, 16), jnp.float32)
  dense = attention.dense_attention(q, k, v, mask)
  through_xla = cudnn.cudnn_attention(q, k, v, attention.dense_mask(mask), implementation=None)
  np.testing.assert_allclose(through_xla, dense, rtol=1e-5, atol=1e-5)
  # attend() hands cuDNN the same call; an odd length (cuDNN needs an even one with a mask) goes dense.
  odd = describe_mask(*(jnp.asarray(batch[f])[:, :63] for f in ("segment_ids", "positions", "prefix_mask")))
  np.testing.assert_array_equal(attention.attend(q[:, :63], k[:, :63], v[:, :63], odd, "cudnn"),
                                attention.dense_attention(q[:, :63], k[:, :63], v[:, :63], odd))


def test_the_gpu_benchmark_config_is_the_paper_1b_and_fits_one_gpu_by_the_analytic_count():
  """gin/experiments/bench_gpu_paper_1b.gin, which launch/gpu_check.sh times per attention path."""
  config, _ = load_run_config([os.path.join(REPO_ROOT, "gin", "experiments", "bench_gpu_paper_1b.gin")], [])
  assert (config.model.num_layers, config.model.d_model, config.model.dtype) == (24, 2048, "bfloat16")
  report = compile_bench.run(config, topology="gpu-1", method="analytic", hbm_gib=141)  # an H200
  assert report["model"]["attention"] == "cudnn" and report["fits"] is True
