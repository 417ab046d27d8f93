"""Conversion to and from transformers: logit and greedy-generation parity with LlamaForCausalLM and
GPT2LMHeadModel on awkward shapes, exact round trips, tokenizers, the CLI on a growing run, refusals.

Needs the `convert` extra (torch CPU, transformers, safetensors); nothing is downloaded.
"""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from midas_jax import cli, configs, convert
from midas_jax.checkpoint import load_model
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.data.vocab.vocabulary import EOS_ID
from midas_jax.errors import ConfigError
from midas_jax.model import Decoder, dummy_batch
from midas_jax.train.run import train

torch = pytest.importorskip("torch", reason="install the convert extra: pip install -e .[convert]")
transformers = pytest.importorskip("transformers", reason="install the convert extra: pip install -e .[convert]")

PROMPT, NEW_TOKENS = 6, 16
BYTE_DATA = configs.DataConfig(seq_len=32, batch_size=4, extra_ids=21)  # 280 ids

# Awkward shapes: GQA with 3 query heads per kv head, head_dim 10 != d_model / num_heads, untied
# head, sizes that are not powers of two, a vocabulary padded from 280 to 300 ids; a looped model.
CASES = {
    "llama_gqa_untied": dict(family="llama", d_model=48, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=10,
                             d_ff=72, tie_embeddings=False, rope_theta=500.0, norm_eps=1e-6, vocab_multiple=60),
    "gpt2": dict(family="gpt2", d_model=40, num_layers=3, num_heads=5, d_ff=88, vocab_multiple=60),
    "llama_looped": dict(family="llama", d_model=36, num_layers=3, num_heads=3, d_ff=60, vocab_multiple=60,
                         loop_start=1, loop_size=1, loop_repeats=3),
}


def model_config(**kw) -> configs.ModelConfig:
  return configs.ModelConfig(max_seq_len=64, dtype="float32", init_std=0.1, **kw).with_vocab(
      make_vocabulary(BYTE_DATA).vocab_size)


def random_params(cfg: configs.ModelConfig, seed: int = 0) -> dict:
  """Initialized params with norm scales and biases moved off 1 and 0, so their maps are tested too."""
  params = nn.unbox(jax.jit(Decoder(cfg).init)(jax.random.key(seed), dummy_batch(1, 8))["params"])
  rng = np.random.default_rng(seed)

  def perturb(path, x):
    x = np.asarray(x, np.float32)
    name = str(path[-1].key)
    return (x + rng.normal(0, 0.2, x.shape)).astype(np.float32) if name in ("scale", "bias") or name.endswith(
        "_bias") else x
  return jax.tree_util.tree_map_with_path(perturb, params)


def zero_params(cfg: configs.ModelConfig) -> dict:
  """Zeros in the shapes of Decoder(cfg)'s params (traced, not compiled: for tests of names and shapes)."""
  shapes = jax.eval_shape(lambda: nn.unbox(Decoder(cfg).init(jax.random.key(0), dummy_batch(1, 8))["params"]))
  return jax.tree.map(lambda a: np.zeros(a.shape, np.float32), shapes)


def causal_batch(tokens: np.ndarray) -> dict:
  batch = dummy_batch(1, len(tokens))
  batch["inputs"] = jnp.asarray(tokens, jnp.int32)[None]
  return batch


def our_logits(cfg, params, tokens) -> np.ndarray:
  """float32 logits [T, V] of a plain causal batch (one sequence, positions 0..T-1, no prefix)."""
  return np.asarray(_forward(cfg)(params, causal_batch(tokens)))[0]


def _forward(cfg):
  return jax.jit(lambda p, b: Decoder(cfg).apply({"params": p}, b))


def our_greedy(cfg, params, prompt, steps: int):
  """Greedy decoding by a full causal forward per token over a fixed-length buffer (one compile)."""
  forward = _forward(cfg)
  buf = np.zeros(len(prompt) + steps, np.int32)
  buf[:len(prompt)] = prompt
  out = []
  for i in range(len(prompt), len(buf)):
    token = int(np.argmax(np.asarray(forward(params, causal_batch(buf)))[0, i - 1]))
    out.append(token)
    if token == EOS_ID:  # transformers' generate stops there too
      break
    buf[i] = token
  return out


def hf_logits(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens)[None], dtype=torch.long)).logits[0].numpy()


def assert_same_tree(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
    assert np.asarray(y).dtype == np.float32, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_matches_our_logits_and_greedy_generation(case, tmp_path):
  cfg = model_config(**CASES[case])
  params = random_params(cfg)
  run = configs.RunConfig(model=cfg, data=BYTE_DATA)
  out = str(tmp_path / "hf")
  files = convert.write_export(params, cfg, run, out, "hf")
  assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md",
          "midas_jax.json"} <= set(files)
  assert not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)  # no pickle
  readme = (tmp_path / "hf" / "README.md").read_text()
  assert "runs every input causally" in readme and "b + 3" in readme  # the limit, and how bytes map to ids
  hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[cfg.family]
  assert hf.dtype == torch.float32

  tokens = np.random.default_rng(1).integers(3, 259, size=PROMPT + NEW_TOKENS)  # the greedy buffer's shape
  ours = our_logits(cfg, params, tokens)
  theirs = hf_logits(hf, tokens)
  assert ours.shape == theirs.shape == (PROMPT + NEW_TOKENS, cfg.vocab_size)
  assert np.abs(ours - theirs).max() <= 1e-4
  np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))
  assert ours.std() > 0.5  # logits spread enough for the argmax check to mean something

  prompt = tokens[:PROMPT]
  generated = hf.generate(torch.tensor(prompt[None]), attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
                          do_sample=False, max_new_tokens=NEW_TOKENS)[0, PROMPT:].tolist()
  assert generated == our_greedy(cfg, params, prompt, NEW_TOKENS)
  assert len(generated) == NEW_TOKENS or generated[-1] == EOS_ID

  back, back_cfg = convert.load_hf(out, base=cfg)
  if cfg.loop_repeats == 1:  # import(export(params)) is exact
    assert back_cfg == cfg
    assert_same_tree(params, back)
  else:  # a looped model comes back as the plain stack it computes
    assert (back_cfg.num_layers, back_cfg.loop_repeats) == (5, 1)
    again = our_logits(back_cfg, back, tokens)
    np.testing.assert_allclose(again, ours, atol=1e-5)
    convert.import_hf(out, str(tmp_path / "imported"))
    imported = load_model(str(tmp_path / "imported"))
    assert (imported.model_config, imported.stage) == (back_cfg, 1)
    assert imported.config.model == back_cfg  # a plain 5-layer model of its own


def test_torch_and_npz_formats_hold_the_same_weights(tmp_path):
  from safetensors.torch import load_file  # pylint: disable=import-outside-toplevel
  cfg = model_config(**CASES["gpt2"])
  params = random_params(cfg, seed=3)
  run = configs.RunConfig(model=cfg, data=BYTE_DATA)
  convert.write_export(params, cfg, run, str(tmp_path / "torch"), "torch")
  convert.write_export(params, cfg, run, str(tmp_path / "npz"), "npz")
  model = transformers.GPT2LMHeadModel(convert.to_hf_config(cfg)).eval()
  model.load_state_dict(load_file(str(tmp_path / "torch" / "model.safetensors")), strict=True)
  tokens = np.arange(3, 23)
  ours = our_logits(cfg, params, tokens)
  assert np.abs(hf_logits(model, tokens) - ours).max() <= 1e-4
  assert_same_tree(params, convert.read_npz(str(tmp_path / "npz")))
  # GPT2Model checkpoints (OpenAI's among them) name their tensors without "transformer.".
  bare = {k.removeprefix("transformer."): v for k, v in convert.to_hf_state_dict(params, cfg).items()}
  assert_same_tree(params, convert.from_hf_state_dict(bare, cfg))
  saved = json.loads((tmp_path / "npz" / "model_config.json").read_text())
  assert configs.ModelConfig(**saved) == cfg


TEXTS = ["Hello world", "  two  spaces\nand a new line\n\n", " leading space", "ünïcødé 漢字 🙂", "x"]


def test_exported_tokenizers_give_our_ids(tmp_path):
  from midas_jax.convert.tokenizer import write_tokenizer  # pylint: disable=import-outside-toplevel
  from midas_jax.data.sources import corpus  # pylint: disable=import-outside-toplevel
  from midas_jax.data.vocab import vocabulary  # pylint: disable=import-outside-toplevel
  text = corpus.write_text_files(str(tmp_path / "data"))["validation"]
  spm = vocabulary.train_sentencepiece([text], str(tmp_path / "spm"), vocab_size=400, input_sentence_size=2000)
  with open(text, encoding="utf-8") as f:
    sample = [line for line in f.read().splitlines() if line][:20]
  for data in (BYTE_DATA, configs.DataConfig(vocab="sentencepiece", spm_model=spm, extra_ids=7)):
    out = tmp_path / data.vocab
    out.mkdir()
    write_tokenizer(str(out), data)
    ours = make_vocabulary(data)
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    for t in TEXTS + sample:
      ids = theirs(t).input_ids
      assert ids == ours.encode(t), (data.vocab, t)
      assert theirs.decode(ids) == ours.decode(ids)
    assert theirs.convert_tokens_to_ids("<extra_id_0>") == ours.extra_id(0) == ours.vocab_size - 1
    assert (theirs.pad_token_id, theirs.eos_token_id, theirs.unk_token_id) == (0, 1, 2)
  with open(spm, "rb") as f:
    assert (tmp_path / "sentencepiece" / "tokenizer.model").read_bytes() == f.read()


@pytest.fixture(scope="module")
def growing_run(tmp_path_factory):
  """2 -> 4 layers (boundary after step 2), a save every step: step 1 is stage 1 at depth 2."""
  config = configs.RunConfig(
      model=tiny_model(num_layers=4, d_model=24, num_heads=3, num_kv_heads=1, d_ff=40),
      optimizer=configs.OptimizerConfig(learning_rate=3e-3, warmup_steps=1),
      data=configs.DataConfig(seq_len=16, batch_size=8),
      trainer=configs.TrainerConfig(num_steps=3, log_every=1, eval_every=0, progress_bar=False,
                                    peak_flops_per_device=1e11),
      stacking=configs.StackingConfig(num_stages=2, stage_steps=(2, 1)),
      checkpoint=configs.CheckpointConfig(every=1, keep=10, async_save=False))
  workdir = str(tmp_path_factory.mktemp("growing"))
  train(config, workdir)
  return workdir


def _cli_json(capsys, argv):
  assert cli.main(argv) == 0, capsys.readouterr().err
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_export_at_any_stage_and_import_round_trip(growing_run, tmp_path, capsys):
  early = load_model(growing_run, step=1)
  assert (early.stage, early.model_config.num_layers) == (1, 2)
  out = str(tmp_path / "early")
  summary = _cli_json(capsys, ["export", f"--workdir={growing_run}", "--step=1", "--format=hf", f"--out={out}"])
  assert (summary["step"], summary["stage"], summary["depth"]) == (1, 1, 2)
  hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert hf.config.num_hidden_layers == 2
  tokens = np.arange(5, 21)
  f32 = dataclasses.replace(early.model_config, dtype="float32")
  ours = our_logits(f32, early.params, tokens)
  assert np.abs(hf_logits(hf, tokens) - ours).max() <= 1e-4

  early_back = str(tmp_path / "early_back")
  assert _cli_json(capsys, ["import", f"--hf={out}", f"--workdir={early_back}"])["depth"] == 2
  back = load_model(early_back)  # mid-growth: the run's config, at the depth it had then
  assert (back.step, back.stage, back.model_config, back.config.model) == (1, 1, early.model_config,
                                                                            early.config.model)
  assert_same_tree(early.params, back.params)

  # The final stage, through a params-only export; then back in with `midas import`.
  params_dir = str(tmp_path / "params")
  _cli_json(capsys, ["export", f"--workdir={growing_run}", "--format=params", f"--out={params_dir}"])
  final = str(tmp_path / "final")
  assert _cli_json(capsys, ["export", f"--workdir={params_dir}", f"--out={final}"])["depth"] == 4
  imported = str(tmp_path / "imported")
  summary = _cli_json(capsys, ["import", f"--hf={final}", f"--workdir={imported}"])
  assert summary["depth"] == 4
  source, back = load_model(params_dir), load_model(imported)
  assert_same_tree(source.params, back.params)
  assert back.model_config == source.model_config and back.config.stacking == source.config.stacking
  assert (back.step, back.stage, back.metadata["imported_from"]) == (source.step, source.stage, final)

  # imported.gin starts a new run from the imported parameters.
  run_dir = tmp_path / "continued"
  assert cli.main(["train", f"--gin_file={imported}/imported.gin", f"--workdir={run_dir}",
                   "--gin.DataConfig.seq_len=16", "--gin.DataConfig.batch_size=8", "--gin.TrainerConfig.num_steps=1",
                   "--gin.TrainerConfig.eval_every=0", "--gin.TrainerConfig.progress_bar=False",
                   "--gin.TrainerConfig.peak_flops_per_device=1e11"]) == 0
  saved = json.loads((run_dir / "config.json").read_text())
  assert saved["checkpoint"]["init_from"] == imported and saved["model"]["num_layers"] == 4


def test_import_of_a_model_made_by_transformers(tmp_path):
  config = transformers.LlamaConfig(vocab_size=320, hidden_size=30, intermediate_size=50, num_hidden_layers=2,
                                    num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
                                    rms_norm_eps=1e-5, tie_word_embeddings=True)
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(config).eval()
  hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="40KB")
  assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) > 1  # sharded
  (tmp_path / "bin").mkdir()
  torch.save(hf.state_dict(), str(tmp_path / "bin" / "pytorch_model.bin"))
  (tmp_path / "bin" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
  assert_same_tree(convert.load_hf(str(tmp_path / "hf"))[0], convert.load_hf(str(tmp_path / "bin"))[0])
  _, meta = convert.import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))
  assert "placeholder byte vocabulary" in meta["tokenizer"]
  loaded = load_model(str(tmp_path / "imported"))
  got = loaded.model_config
  assert (got.num_kv_heads, got.vocab_size, got.head_dim, got.tie_embeddings) == (1, 320, None, True)
  assert loaded.vocab.vocab_size <= 320
  f32 = dataclasses.replace(loaded.model_config, dtype="float32")
  tokens = np.arange(3, 40)
  ours = our_logits(f32, loaded.params, tokens)
  assert np.abs(hf_logits(hf, tokens) - ours).max() <= 1e-4


@pytest.mark.parametrize("overrides, setting", [
    (dict(family="gpt2", d_model=40, num_heads=5, head_dim=6), "ModelConfig.head_dim"),
    (dict(family="llama", d_model=50, num_heads=4, head_dim=12), "ModelConfig.num_heads"),
])
def test_export_refuses_what_transformers_cannot_compute(overrides, setting, tmp_path):
  cfg = model_config(num_layers=1, d_ff=16, **overrides)
  with pytest.raises(ConfigError, match=setting):
    convert.write_export(zero_params(cfg), cfg, configs.RunConfig(model=cfg, data=BYTE_DATA), str(tmp_path), "hf")
  assert not os.listdir(tmp_path)  # refused before writing anything


def test_import_refuses_what_we_cannot_compute(tmp_path):
  base = dict(vocab_size=300, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)
  for key, value in (("hidden_act", "gelu"), ("attention_bias", True)):
    with pytest.raises(ConfigError, match=key):
      convert.model_config_from_hf(transformers.LlamaConfig(**base, **{key: value}))
  with pytest.raises(ConfigError, match="activation_function"):
    convert.model_config_from_hf(transformers.GPT2Config(n_embd=16, n_head=2, n_layer=1, activation_function="relu"))
  cfg = convert.model_config_from_hf(transformers.LlamaConfig(**base))
  state = convert.to_hf_state_dict(zero_params(cfg), cfg)
  with pytest.raises(ConfigError, match="no place"):
    convert.from_hf_state_dict({**state, "model.adapter.weight": np.zeros(3, np.float32)}, cfg)
  with pytest.raises(ConfigError, match="shape"):
    convert.from_hf_state_dict({**state, "model.norm.weight": np.zeros(3, np.float32)}, cfg)


def test_cli_refuses_bad_flags(tmp_path, capsys):
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("taken")
  assert cli.main(["export", f"--workdir={tmp_path}", "--format=onnx", f"--out={tmp_path / 'o'}"]) == 2
  assert "--format" in capsys.readouterr().err
  assert cli.main(["export", f"--workdir={tmp_path / 'nothing'}", f"--out={tmp_path / 'o'}"]) == 2
  assert "--workdir" in capsys.readouterr().err
  assert cli.main(["import", f"--hf={tmp_path / 'nothing'}", f"--workdir={tmp_path / 'o'}"]) == 2
  assert "--hf" in capsys.readouterr().err
  assert cli.main(["import", f"--hf={tmp_path}", f"--workdir={tmp_path / 'full'}"]) == 2
  assert "is not empty" in capsys.readouterr().err
