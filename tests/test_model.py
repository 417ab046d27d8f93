"""The decoder: parameter layout and axes, the attention mask, GQA, init schemes, remat, dtypes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import layer_config, tiny_model
from midas_jax.data.ul2.packing import Example, pack_row, stack_rows
from midas_jax.model import Decoder, describe_mask, dummy_batch, make_attention_mask
from midas_jax.model.layers import Block, Norm

LOGICAL = {"batch", "length", "embed", "heads", "kv", "mlp", "vocab", "layers"}


def init(cfg, seq_len=16):
  cfg = cfg.with_vocab(300)
  model = Decoder(cfg)
  variables = model.init(jax.random.key(0), dummy_batch(1, seq_len))
  return cfg, model, variables


def leaves_with_names(tree):
  return {"/".join(str(k.key) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_param_has_logical_axes_and_layer_params_lead_with_layers(family):
  cfg = tiny_model(family=family, num_kv_heads=None, num_layers=3)
  cfg, _, variables = init(cfg)
  specs = leaves_with_names(nn.get_partition_spec(variables["params"]))
  shapes = leaves_with_names(nn.unbox(variables["params"]))
  assert specs.keys() == shapes.keys()
  for name, spec in specs.items():
    assert len(spec) == shapes[name].ndim, name
    assert set(spec) <= LOGICAL, (name, spec)
    if name.startswith("layers/"):
      assert spec[0] == "layers" and shapes[name].shape[0] == 3, name
    else:
      assert "layers" not in spec, name


def test_llama_and_gpt2_param_sets():
  _, _, llama = init(tiny_model(tie_embeddings=False))
  names = set(leaves_with_names(nn.unbox(llama["params"])))
  assert {"head", "layers/mlp/gate", "layers/mlp/up", "layers/mlp/down"} <= names
  assert not any("bias" in n for n in names) and "position_embedding" not in names
  _, _, gpt2 = init(tiny_model(family="gpt2", num_kv_heads=None))
  names = set(leaves_with_names(nn.unbox(gpt2["params"])))
  assert {"position_embedding", "layers/attn/query_bias", "layers/mlp/fc", "layers/attn_norm/bias"} <= names
  assert "head" not in names  # gpt2 ties its embeddings


def test_mask_causal_prefix_and_segments():
  # One row: segment 1 = 3 tokens with a 1-token prefix (so BOS + 1 bidirectional), segment 2 = 2 tokens.
  row = pack_row([Example(np.array([5, 6, 7]), prefix_len=1), Example(np.array([8, 9]))], 6)
  batch = stack_rows([row])
  mask = np.asarray(make_attention_mask(batch["segment_ids"], batch["positions"], batch["prefix_mask"]))[0, 0]
  expected = np.array([
      [1, 1, 0, 0, 0, 0],  # BOS sees the whole prefix (itself and token 5)
      [1, 1, 0, 0, 0, 0],
      [1, 1, 1, 0, 0, 0],  # first target position: causal
      [0, 0, 0, 1, 0, 0],  # segment 2 starts fresh
      [0, 0, 0, 1, 1, 0],
      [0, 0, 0, 0, 0, 1],  # padding sees only itself
  ], bool)
  np.testing.assert_array_equal(mask, expected)


def _forward(cfg, params, batch):
  return np.asarray(Decoder(cfg).apply(params, {k: jnp.asarray(v) for k, v in batch.items()}))


def test_attention_never_crosses_segments_and_prefix_is_bidirectional():
  cfg, _, params = init(tiny_model())
  rng = np.random.default_rng(0)
  a, b = rng.integers(3, 250, 6), rng.integers(3, 250, 6)
  base = stack_rows([pack_row([Example(a, prefix_len=3), Example(b)], 16)])
  changed_b = stack_rows([pack_row([Example(a, prefix_len=3), Example(b[::-1].copy())], 16)])
  out, out_b = _forward(cfg, params, base), _forward(cfg, params, changed_b)
  np.testing.assert_allclose(out[0, :6], out_b[0, :6], atol=1e-6)  # segment 1 untouched by segment 2
  assert not np.allclose(out[0, 6:12], out_b[0, 6:12])
  # Changing the last prefix token changes the logits at the first prefix position (bidirectional) ...
  a2 = a.copy()
  a2[2] = (a[2] + 1) % 250 + 3
  changed_prefix = stack_rows([pack_row([Example(a2, prefix_len=3), Example(b)], 16)])
  out_p = _forward(cfg, params, changed_prefix)
  assert not np.allclose(out[0, 0], out_p[0, 0])
  # ... while changing a target token never reaches earlier positions (causal).
  a3 = a.copy()
  a3[4] = (a[4] + 1) % 250 + 3
  out_t = _forward(cfg, params, stack_rows([pack_row([Example(a3, prefix_len=3), Example(b)], 16)]))
  np.testing.assert_allclose(out[0, :5], out_t[0, :5], atol=1e-6)


def test_grouped_query_attention_equals_mha_with_repeated_kv():
  gqa_cfg, _, gqa = init(tiny_model(num_heads=4, num_kv_heads=2))
  mha_cfg = tiny_model(num_heads=4, num_kv_heads=None).with_vocab(300)
  params = jax.tree.map(np.asarray, nn.unbox(gqa))
  attn = params["params"]["layers"]["attn"]
  for name in ("key", "value"):
    attn[name] = np.repeat(attn[name], 2, axis=2)  # kv head j serves query heads 2j, 2j+1
  batch = {k: np.asarray(v) for k, v in dummy_batch(2, 16).items()}
  batch["inputs"] = np.random.default_rng(1).integers(3, 250, (2, 16)).astype(np.int32)
  np.testing.assert_allclose(_forward(gqa_cfg, gqa, batch), _forward(mha_cfg, params, batch), atol=2e-5)


def test_scanned_forward_equals_per_layer_forward():
  cfg, model, variables = init(tiny_model(num_layers=3))
  params = nn.unbox(variables)["params"]
  batch = dummy_batch(2, 16)
  batch["inputs"] = jax.random.randint(jax.random.key(1), (2, 16), 3, 250)
  expected = model.apply(variables, batch)
  mask = describe_mask(batch["segment_ids"], batch["positions"], batch["prefix_mask"])
  x = model.apply(variables, batch["inputs"], batch["positions"], method=Decoder.embed)
  for i in range(cfg.num_layers):
    layer = jax.tree.map(lambda p: p[i], params["layers"])
    x, _ = Block(layer_config(cfg)).apply({"params": layer}, x, batch["positions"], mask)
  x = Norm(cfg).apply({"params": params["final_norm"]}, x)
  logits = jnp.einsum("btd,vd->btv", x, params["embedding"])
  np.testing.assert_allclose(expected, logits, atol=1e-5)


@pytest.mark.parametrize("gamma", [0.3, 0.8])
def test_gamma_init_std_is_fan_in_to_the_minus_gamma(gamma):
  cfg = tiny_model(init="gamma", init_gamma=gamma, d_model=64, d_ff=256, num_heads=4, num_kv_heads=None,
                   tie_embeddings=False)
  cfg, _, variables = init(cfg)
  p = leaves_with_names(nn.unbox(variables["params"]))
  fan_in = {"embedding": 64, "head": 64, "layers/attn/query": 64, "layers/attn/out": 64,
            "layers/mlp/gate": 64, "layers/mlp/down": 256}
  for name, fan in fan_in.items():
    assert np.std(p[name]) == pytest.approx(fan ** -gamma, rel=0.08), name
  assert np.all(p["layers/attn_norm/scale"] == 1.0)


def test_default_init_is_gpt2_style():
  cfg = tiny_model(d_model=64, d_ff=256, num_layers=8, num_heads=4, num_kv_heads=None)
  cfg, _, variables = init(cfg)
  p = leaves_with_names(nn.unbox(variables["params"]))
  assert np.std(p["layers/attn/query"]) == pytest.approx(0.02, rel=0.05)
  assert np.std(p["layers/mlp/down"]) == pytest.approx(0.02 / np.sqrt(16), rel=0.05)


def _loss_and_grads(cfg, params, batch):
  def loss(p):
    return jnp.mean(Decoder(cfg).apply({"params": p}, batch) ** 2)
  return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize("policy", ["full", "minimal", "save_dots", "offload"])
def test_remat_does_not_change_values(policy):
  cfg, _, variables = init(tiny_model())
  params = nn.unbox(variables)["params"]
  batch = dummy_batch(2, 16)
  base = _loss_and_grads(cfg, params, batch)
  remat = _loss_and_grads(tiny_model(remat_policy=policy).with_vocab(300), params, batch)
  np.testing.assert_allclose(base[0], remat[0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), base[1], remat[1])


def _grad_jaxpr_lines(policy: str):
  cfg = tiny_model(remat_policy=policy).with_vocab(300)
  params = nn.unbox(init(tiny_model())[2])["params"]
  batch = dummy_batch(2, 16)
  return str(jax.make_jaxpr(jax.grad(lambda p: jnp.mean(Decoder(cfg).apply({"params": p}, batch) ** 2)))(params))


@pytest.mark.parametrize("policy", ["full", "minimal", "save_dots", "offload"])
def test_offload_keeps_each_layers_input_in_host_memory_and_only_it(policy):
  """Under 'offload' the forward pass moves each layer's input [batch, length, embed] to host memory (a
  device_put to MemorySpace.Host), the layer scan's saved residual is those inputs stacked over the layers
  in host memory, and the backward pass moves them back; no other policy puts anything on the host. (XLA's
  CPU backend lowers the placement away, so the check is on the program as jax traces it; on TPU the
  compiled program holds the copies.)"""
  text = _grad_jaxpr_lines(policy)
  layers, batch, length, embed = 2, 2, 16, 32
  to_host = text.count("devices=(MemorySpace.Host,)")
  to_device = text.count("devices=(MemorySpace.Device,)")
  stacked = text.count(f"f32<host>[{layers},{batch},{length},{embed}]")
  if policy == "offload":
    assert to_host == 1 and to_device == 1 and stacked >= 1, (to_host, to_device, stacked)
    assert "<host>" not in text.replace(f"f32<host>[{batch},{length},{embed}]", "").replace(
        f"f32<host>[{layers},{batch},{length},{embed}]", "")  # nothing but the layer inputs
  else:
    assert "<host>" not in text and to_host == 0


def test_bf16_compute_keeps_f32_params_and_logits():
  cfg, model, variables = init(tiny_model(dtype="bfloat16"))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nn.unbox(variables)))
  logits = model.apply(variables, dummy_batch(2, 16))
  assert logits.dtype == jnp.float32
  f32 = Decoder(tiny_model().with_vocab(300)).apply(variables, dummy_batch(2, 16))
  # bf16 rounding moves these logits (|logit| < 0.7) by 0.0016 at most: allow three times that, and
  # require a difference at all, or the model did not compute in bf16.
  difference = np.max(np.abs(np.asarray(logits) - np.asarray(f32)))
  assert 0 < difference < 0.005
