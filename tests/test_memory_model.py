"""The GPU side of the analytic memory count: cuDNN's mask as jax hands it to cuDNN (a bias and its gradient),
and "fits" only within the stated headroom."""

import inspect
import json
import pathlib

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_jax

from conftest import REPO_ROOT
from midas_jax import hardware
from midas_jax.analysis import memory_model
from midas_jax.configs import ModelConfig

GIB = 2 ** 30


def test_the_installed_jax_makes_the_mask_a_bias_and_exports_its_gradient_as_counted():
  """What cudnn_mask_bytes counts, read off the jax that runs it: a boolean [2, 1, 8, 8] mask becomes a bfloat16
  bias of the same shape; up to jax 0.11.0 the backward pass returns its gradient too, later ones skip a
  boolean mask's (the guard they compute has_dbias with)."""
  mask = jnp.ones((2, 1, 8, 8), bool)
  bias = cudnn_jax.combine_bias_and_mask(None, mask, jnp.bfloat16)
  assert bias.shape == (2, 1, 8, 8) and bias.dtype == jnp.bfloat16
  assert cudnn_jax.should_export_dbias(bias.shape, (2, 8, 4, 16), cudnn_jax.AttentionLayout.BTNH)
  skips_mask_dbias = "bias_is_differentiable" in inspect.getsource(cudnn_jax.dot_product_attention)
  counted = memory_model.cudnn_mask_bytes(2, 8, 2)["dbias"]
  assert counted == (0 if skips_mask_dbias else 256), jax.__version__


def test_cudnn_counts_the_mask_its_bias_and_the_bias_gradient():
  # 2 rows of 8 positions: 2 * 8 * 8 = 128 mask elements; 1 byte each as booleans, 2 as the bfloat16 bias,
  # 2 as its gradient.
  assert memory_model.cudnn_mask_bytes(2, 8, 2, "0.10.2") == {"mask": 128, "bias": 256, "dbias": 256}
  assert memory_model.cudnn_mask_bytes(2, 8, 2, "0.11.2") == {"mask": 128, "bias": 256, "dbias": 0}
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, d_ff=64, dtype="bfloat16",
                    remat_policy="none")
  flash = memory_model.activation_bytes(cfg, rows=2, seq_len=8, attention="flash")
  cudnn = memory_model.activation_bytes(cfg, rows=2, seq_len=8, attention="cudnn")
  dbias = memory_model.cudnn_mask_bytes(2, 8, 2)["dbias"]  # 256 under this jax (0.10), 0 after 0.11.0
  assert cudnn["working"] - flash["working"] == 128 + 256 + dbias  # the backward holds the bias (and writes dbias)
  assert cudnn["saved"] - flash["saved"] == 3 * (128 + 256)  # no remat: each layer keeps its mask and bias
  assert cudnn["logits"] == flash["logits"]


def test_a_step_at_95_percent_of_a_gpu_does_not_fit_but_does_on_a_tpu():
  hbm = hardware.GPU_HBM_BYTES
  assert memory_model.GPU_USABLE_FRACTION == 0.90
  assert memory_model.fits(int(0.95 * hbm), hbm, "gpu") is False
  assert memory_model.fits(int(0.89 * hbm), hbm, "gpu") is True
  assert memory_model.fits(int(0.95 * hbm), hbm, "tpu") is True  # a compiled TPU peak is the compiler's own plan
  assert memory_model.fits(1, None, "gpu") is None


def test_the_largest_batch_on_a_gpu_leaves_the_headroom():
  analytic = {"activations": 10 * GIB, "total": 12 * GIB}  # 2 GiB fixed, 1 GiB a row at 10 rows
  assert memory_model.max_global_batch(analytic, 10, 20 * GIB, batch_shards=8, platform="tpu") == 18 * 8
  assert memory_model.max_global_batch(analytic, 10, 20 * GIB, batch_shards=8, platform="gpu") == 16 * 8


def test_the_docs_gpu_rows_say_fits_only_within_the_headroom():
  """docs/results/pod_memory.json's gpu-8 rows (docs/pods.md) against the rule: none 'fits' above 90%."""
  table = json.loads(pathlib.Path(REPO_ROOT, "docs/results/pod_memory.json").read_text())["tables"]["peak_memory"]
  at = {name: i for i, name in reversed(list(enumerate(table["columns"])))}  # the first 'fits' is 'before'
  rows = [r for r in table["rows"] if r[at["target"]] == "`gpu-8`"]
  assert rows
  for r in rows:
    for peak, said in ((r[at["before: peak GiB"]], r[at["fits"]]), (r[at["after: peak GiB"]], r[at["fits"] + 2])):
      total = float(peak.split()[0]) * GIB
      assert said == ("yes" if memory_model.fits(total, hardware.GPU_HBM_BYTES, "gpu") else "**no**"), r

