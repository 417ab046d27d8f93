"""Pretrained models in and out with their own tokenizers.

A GPT-2 with a byte-level BPE trained by `tokenizers`, and a Llama with a SentencePiece model in
Llama's id layout (unk 0, bos 1, eos 2), are built and saved by transformers in the test; each is
imported, trained a few steps on text (the Llama grown by MIDAS from its own depth), exported and
reloaded by transformers: logits within 1e-4 and the same encodings, special tokens included. A
Qwen2 round trip, sharded and bfloat16 exports. Needs the `convert` extra; nothing is downloaded.
"""

import dataclasses
import json
import os

import numpy as np
import pytest

from midas_jax import cli, configs, convert, gin_config
from midas_jax.checkpoint import load_model
from midas_jax.convert import shards
from midas_jax.data.sources import corpus
from midas_jax.errors import ConfigError
from midas_jax.train.run import train
from test_convert import hf_logits, our_logits

torch = pytest.importorskip("torch", reason="install the convert extra: pip install -e .[convert]")
transformers = pytest.importorskip("transformers", reason="install the convert extra: pip install -e .[convert]")

PLAIN = "Once upon a time, a cat sat on the mat.\nThen  two spaces, ünïcødé and 🙂."


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
  """A small text corpus (part of the built-in one): tokenizers train on it, the runs read it."""
  docs = [d.text for d in corpus.documents("validation")]
  out = tmp_path_factory.mktemp("text")
  paths = {}
  for split, part in (("train", docs[:400]), ("validation", docs[400:440])):
    paths[split] = str(out / f"{split}.txt")
    (out / f"{split}.txt").write_text("\n\n".join(part) + "\n", encoding="utf-8")
  return paths


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, text_files):
  """A GPT-2 whose tokenizer is a byte-level BPE (<|endoftext|> = bos = eos = unk, no pad)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  bpe.train([text_files["train"]], trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  out = str(tmp_path_factory.mktemp("gpt2"))
  end = "<|endoftext|>"
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=end, eos_token=end, unk_token=end)
  tok.save_pretrained(out)
  config = transformers.GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                   initializer_range=0.2, bos_token_id=0, eos_token_id=0)
  torch.manual_seed(0)
  transformers.GPT2LMHeadModel(config).save_pretrained(out)
  return out


@pytest.fixture(scope="module")
def llama_spm(tmp_path_factory, text_files):
  """A SentencePiece model in Llama's id layout (SentencePiece's defaults): unk 0, bos 1, eos 2, no pad."""
  import sentencepiece
  prefix = str(tmp_path_factory.mktemp("spm") / "tokenizer")
  sentencepiece.SentencePieceTrainer.Train(input=text_files["train"], model_prefix=prefix, vocab_size=400,
                                          model_type="bpe", byte_fallback=True, character_coverage=0.99,
                                          minloglevel=2)
  return prefix + ".model"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, llama_spm):
  """A 4-layer Llama (GQA, untied head) with that tokenizer, both saved by transformers."""
  out = str(tmp_path_factory.mktemp("llama"))
  tok = transformers.LlamaTokenizer.from_pretrained(os.path.dirname(llama_spm))
  assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, None)
  tok.save_pretrained(out)
  config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
  torch.manual_seed(1)
  transformers.LlamaForCausalLM(config).save_pretrained(out)
  return out


def _ids(directory, text, **kw):
  return transformers.AutoTokenizer.from_pretrained(directory)(text, **kw).input_ids


def _check_import(hf_dir, imported, specials_text):
  """The import keeps the tokenizer's ids and the model's logits on them; returns the loaded import."""
  loaded = load_model(imported)
  vocab = loaded.vocab
  base = len(transformers.AutoTokenizer.from_pretrained(hf_dir))
  assert vocab.base_size == base and loaded.model_config.vocab_size >= vocab.vocab_size == base + 128
  assert vocab.encode(PLAIN) == _ids(hf_dir, PLAIN, add_special_tokens=False)
  assert vocab.decode(vocab.encode(PLAIN)) == PLAIN
  assert vocab.pad_id == base  # neither tokenizer has a pad: appended at the first extra id
  assert loaded.metadata["vocabulary"]["appended"] == {str(base): "<pad>"}
  hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
  tokens = np.asarray(_ids(hf_dir, specials_text))
  ours = our_logits(dataclasses.replace(loaded.model_config, dtype="float32"), loaded.params, tokens)
  assert np.abs(ours[:, :base] - hf_logits(hf, tokens)).max() <= 1e-4
  return loaded


def _check_export(run_dir, out, hf_dir, specials_text):
  """The export reloads in transformers with our logits, and tokenizes as the original did."""
  trained = load_model(run_dir)
  hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = np.asarray(_ids(hf_dir, specials_text))
  ours = our_logits(dataclasses.replace(trained.model_config, dtype="float32"), trained.params, tokens)
  theirs = hf_logits(hf, tokens)
  assert ours.shape == theirs.shape and np.abs(ours - theirs).max() <= 1e-4
  assert _ids(out, specials_text) == _ids(hf_dir, specials_text)
  vocab = trained.vocab
  exported = transformers.AutoTokenizer.from_pretrained(out)
  assert exported.convert_tokens_to_ids("<extra_id_0>") == vocab.vocab_size - 1 and exported.pad_token_id == vocab.pad_id
  special = json.loads(open(os.path.join(out, "config.json")).read())["midas_jax_special_tokens"]
  assert special["pad_id"] == vocab.pad_id and special["sentinel_ids"][0] == vocab.vocab_size - 1
  return trained


TRAIN_BINDINGS = ["DataConfig.seq_len=32", "DataConfig.batch_size=8", "TrainerConfig.num_steps=2",
                  "TrainerConfig.log_every=2", "TrainerConfig.eval_every=0", "TrainerConfig.progress_bar=False",
                  "TrainerConfig.peak_flops_per_device=1e11", "CheckpointConfig.every=0",
                  "CheckpointConfig.async_save=False", "OptimizerConfig.learning_rate=1e-3",
                  "OptimizerConfig.warmup_steps=1"]


def _training(loaded, imported, text_files, **kw) -> configs.RunConfig:
  data = dataclasses.replace(loaded.config.data, source="text", train_files=(text_files["train"],),
                             eval_files=(text_files["validation"],), seq_len=32, batch_size=8)
  return dataclasses.replace(
      loaded.config, data=data, optimizer=configs.OptimizerConfig(learning_rate=1e-3, warmup_steps=1),
      trainer=configs.TrainerConfig(num_steps=2, log_every=2, eval_every=0, progress_bar=False,
                                    peak_flops_per_device=1e11),
      checkpoint=configs.CheckpointConfig(every=0, async_save=False, init_from=imported), **kw)


def test_gpt2_with_its_bpe_trains_and_exports_sharded(gpt2_dir, text_files, tmp_path, capsys):
  specials = "Hello<|endoftext|> world <|endoftext|>"
  imported = str(tmp_path / "imported")
  summary = json.loads(_cli(capsys, ["import", f"--hf={gpt2_dir}", f"--workdir={imported}"]))
  assert summary["vocab_size"] == 640  # 400 tokens + 128 extra ids, rounded up to a multiple of 128
  loaded = _check_import(gpt2_dir, imported, specials)
  assert (loaded.vocab.eos_id, loaded.metadata["embedding_rows_added"]) == (0, 240)
  run = str(tmp_path / "run")
  result = train(_training(loaded, imported, text_files), run, devices=[jax_device()])
  assert np.isfinite(result.final_loss)
  out = str(tmp_path / "hf")
  _cli(capsys, ["export", f"--workdir={run}", f"--out={out}", "--max_shard_size=60KB"])
  weight_map = json.loads(open(os.path.join(out, shards.INDEX_FILE)).read())["weight_map"]
  per_file = {f: [n for n, g in weight_map.items() if g == f] for f in set(weight_map.values())}
  assert len(per_file) > 2  # a shard holds at most 60KB of tensors, or one larger tensor alone
  assert all(os.path.getsize(os.path.join(out, f)) < 61_000 or len(names) == 1 for f, names in per_file.items())
  trained = _check_export(run, out, gpt2_dir, specials)
  # The export comes back with the run's vocabulary, not the extended tokenizer it was written with.
  back = str(tmp_path / "back")
  convert.import_hf(out, back)
  assert load_model(back).vocab.fingerprint == trained.vocab.fingerprint


def test_llama_with_its_sentencepiece_grows_from_its_depth(llama_dir, text_files, tmp_path, capsys):
  specials = "<s> Hello</s> wörld <unk>\n"
  imported = str(tmp_path / "imported")
  _cli(capsys, ["import", f"--hf={llama_dir}", f"--workdir={imported}"])
  loaded = _check_import(llama_dir, imported, specials)
  assert (loaded.vocab.unk_id, loaded.vocab.bos_id, loaded.vocab.eos_id) == (0, 1, 2)
  assert loaded.model_config.num_layers == 4 and not loaded.model_config.tie_embeddings
  # The recipe of docs/stacking.md (on one device, to compile less): 2 blocks of 2 layers grow to 3 by
  # MIDAS, stage 1 being the import.
  gin_config.parse(["data/text_files.gin", f"{imported}/imported.gin"], [
      f"DataConfig.train_files=['{text_files['train']}']", f"DataConfig.eval_files=['{text_files['validation']}']",
      "ModelConfig.num_layers=6", "StackingConfig.num_stages=2", "StackingConfig.block_size=2",
      "StackingConfig.start_blocks=2", "StackingConfig.stage_steps=(1, 1)", *TRAIN_BINDINGS])
  config = gin_config.run_config_from_gin()
  assert config.checkpoint.init_from == imported and config.data.vocab == "tokenizers"
  run = tmp_path / "run"
  result = train(config, str(run), devices=[jax_device()])
  assert [(g["from_depth"], g["to_depth"], g["provenance"]) for g in result.growths] == [(4, 6, [0, 1, 0, 1, 2, 3])]
  out = str(tmp_path / "hf")
  _cli(capsys, ["export", f"--workdir={run}", f"--out={out}"])
  assert transformers.AutoConfig.from_pretrained(out).num_hidden_layers == 6
  _check_export(str(run), out, llama_dir, specials)


def test_a_tokenizer_model_alone_is_converted_as_transformers_would(llama_dir, llama_spm, tmp_path):
  from midas_jax.convert.tokenizer import import_tokenizer
  old_style = tmp_path / "old_style"  # tokenizer.model and tokenizer_config.json, no tokenizer.json
  transformers.AutoTokenizer.from_pretrained(llama_dir).save_pretrained(str(old_style))
  os.remove(old_style / "tokenizer.json")
  (old_style / "tokenizer.model").write_bytes(open(llama_spm, "rb").read())
  (old_style / "config.json").write_text(open(os.path.join(llama_dir, "config.json")).read())
  settings, note = import_tokenizer(str(old_style), str(tmp_path / "tok"))
  assert settings == {"vocab": "tokenizers", "tokenizer": str(tmp_path / "tok")} and "converted" in note
  text = "<s> Hello</s>  two  spaces\n"
  assert _ids(str(tmp_path / "tok"), text) == _ids(str(old_style), text)


def test_qwen2_round_trip_and_bfloat16_export(tmp_path):
  config = transformers.Qwen2Config(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                                    max_position_embeddings=64, tie_word_embeddings=True, initializer_range=0.2)
  torch.manual_seed(2)
  hf = transformers.Qwen2ForCausalLM(config).eval()
  with torch.no_grad():  # biases off zero, so their maps are tested
    for layer in hf.model.layers:
      for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
        proj.bias.normal_(0, 0.5)
  hf.save_pretrained(str(tmp_path / "qwen"))
  params, cfg = convert.load_hf(str(tmp_path / "qwen"))
  assert (cfg.family, cfg.qkv_bias, cfg.head_dim, cfg.kv_heads) == ("llama", True, 10, 2)
  tokens = np.arange(3, 40)
  f32 = dataclasses.replace(cfg, dtype="float32")
  ours = our_logits(f32, params, tokens)
  assert np.abs(ours - hf_logits(hf, tokens)).max() <= 1e-4
  run = configs.RunConfig(model=cfg, data=configs.DataConfig(extra_ids=21, seq_len=32))
  convert.write_export(params, cfg, run, str(tmp_path / "out"), "hf")
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  assert type(back).__name__ == "Qwen2ForCausalLM"
  assert np.abs(hf_logits(back, tokens) - ours).max() <= 1e-4
  again, again_cfg = convert.load_hf(str(tmp_path / "out"), base=cfg)
  assert again_cfg == cfg and all(np.array_equal(a, b) for a, b in zip(_leaves(params), _leaves(again)))
  with pytest.raises(ConfigError, match="387 ids"):  # a byte vocabulary with 128 extra ids needs more rows
    convert.write_export(params, cfg, dataclasses.replace(run, data=configs.DataConfig(seq_len=32)),
                          str(tmp_path / "refused"), "hf")
  assert not (tmp_path / "refused").exists()
  convert.write_export(params, cfg, run, str(tmp_path / "bf16"), "hf", dtype="bfloat16")
  half = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16")).eval()
  assert half.dtype == torch.bfloat16
  with torch.no_grad():
    approx = half(torch.tensor(tokens[None])).logits[0].float().numpy()
  assert np.abs(approx - ours).max() < 0.1 * np.abs(ours).max()


def test_shard_plan_and_size_flags():
  sizes = [(3,), (2,), (2, 3), (1,), (1,)]  # 12, 8, 24, 4 and 4 bytes of float32
  tensors = [convert.mapping.HFTensor(f"t{i}", s, None) for i, s in enumerate(sizes)]
  plan = {name: [t.name for t in shard] for name, shard in shards.plan(tensors, 4, 20).items()}
  # in order, the 24-byte tensor alone, in a file before the shard being filled (huggingface_hub's split)
  assert plan == {"model-00001-of-00003.safetensors": ["t2"], "model-00002-of-00003.safetensors": ["t0", "t1"],
                  "model-00003-of-00003.safetensors": ["t3", "t4"]}
  assert list(shards.plan(tensors, 4, 100)) == [shards.WEIGHTS_FILE]
  assert shards.parse_size("5GB") == 5 * 10 ** 9 and shards.parse_size("2MiB") == 2 << 20
  assert shards.parse_size(1234) == 1234
  for bad in ("lots", "0", "-1GB", "5 parsecs"):
    with pytest.raises(ConfigError, match="--max_shard_size"):
      shards.parse_size(bad)
  with pytest.raises(ConfigError, match="--dtype"):
    shards.numpy_dtype("float16")


def _leaves(tree):
  import jax
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def jax_device():
  import jax
  return jax.devices()[0]


def _cli(capsys, argv) -> str:
  assert cli.main(argv) == 0, capsys.readouterr().err
  return capsys.readouterr().out.strip().splitlines()[-1]
