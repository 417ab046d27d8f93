"""Vocabularies: id layout, round trips, sentinels, SentencePiece training, parity with seqio."""

import importlib.util
import json

import pytest
import sentencepiece
from hypothesis import given, settings, strategies as st

from midas_jax.configs import DataConfig
from midas_jax.data.sources import corpus
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.data.vocab.vocabulary import ByteVocabulary, SentencePieceVocabulary, train_sentencepiece
from midas_jax.errors import ConfigError

TEXTS = ["", "hello world", "héllo wörld — 日本語 🙂", "tab\tand\nnewline", "\x00\x7f\xff"]
needs_seqio = pytest.mark.skipif(importlib.util.find_spec("seqio") is None,
                                 reason="seqio is an optional extra")


def test_byte_layout_matches_utf8_plus_three():
  v = ByteVocabulary()
  assert (v.pad_id, v.eos_id, v.unk_id, v.extra_ids, v.vocab_size) == (0, 1, 2, 128, 387)
  assert v.encode("Aé") == [0x41 + 3, 0xC3 + 3, 0xA9 + 3]
  assert v.encode("") == []


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
  v = ByteVocabulary()
  ids = v.encode(text)
  assert all(3 <= i < 259 for i in ids)
  assert v.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8")))
def test_byte_round_trip_any_text(text):
  v = ByteVocabulary(extra_ids=7)
  assert v.decode(v.encode(text)) == text


def test_byte_decode_skips_specials_sentinels_and_out_of_range_ids():
  v = ByteVocabulary(extra_ids=4)
  ids = [0, *v.encode("ab"), 1, v.extra_id(0), 2, *v.encode("c"), v.vocab_size + 5, 0]
  assert v.decode(ids) == "abc"
  assert v.decode([0xFF + 3, *v.encode("x")]) == "\ufffdx"  # a lone 0xff byte is not UTF-8


def test_extra_ids_count_down_from_the_top():
  v = ByteVocabulary(extra_ids=128)
  assert v.extra_id(0) == v.vocab_size - 1 == 386
  assert v.extra_id(127) == 259  # the first id after the bytes
  assert len({v.extra_id(i) for i in range(128)}) == 128
  with pytest.raises(IndexError):
    v.extra_id(128)
  with pytest.raises(IndexError):
    ByteVocabulary(extra_ids=0).extra_id(0)
  assert ByteVocabulary(extra_ids=0).vocab_size == 259


def test_negative_extra_ids_name_the_setting():
  with pytest.raises(ConfigError) as e:
    make_vocabulary(DataConfig(extra_ids=-1))
  assert e.value.setting == "DataConfig.extra_ids"


@needs_seqio
@pytest.mark.parametrize("extra_ids", [0, 128])
def test_byte_ids_equal_seqio(extra_ids):
  ours = ByteVocabulary(extra_ids)
  theirs = ours.to_seqio()
  assert theirs.vocab_size == ours.vocab_size
  assert (theirs.pad_id, theirs.eos_id, theirs.unk_id) == (ours.pad_id, ours.eos_id, ours.unk_id)
  for text in TEXTS + [d.text for d in corpus.documents("validation")[:20]]:
    assert list(theirs.encode(text)) == ours.encode(text)
    assert theirs.decode(ours.encode(text)) == text


# ---------------------------------------------------------------------------------------------
# SentencePiece

@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
  d = tmp_path_factory.mktemp("spm")
  text = d / "train.txt"
  lines = [doc.text for doc in corpus.documents("validation")[:300]] + ["naïve café"]
  text.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return train_sentencepiece([str(text)], str(d / "m"), vocab_size=400, hard_vocab_limit=False)


def test_train_sentencepiece_writes_our_layout(spm_model):
  p = sentencepiece.SentencePieceProcessor(model_file=spm_model)
  assert spm_model.endswith(".model")
  assert (p.pad_id(), p.eos_id(), p.unk_id(), p.bos_id()) == (0, 1, 2, -1)


def test_sentencepiece_vocab_round_trip_and_sentinels(spm_model):
  v = SentencePieceVocabulary(spm_model, extra_ids=10)
  pieces = sentencepiece.SentencePieceProcessor(model_file=spm_model).GetPieceSize()
  assert v.vocab_size == pieces + 10 and (v.pad_id, v.eos_id, v.unk_id) == (0, 1, 2)
  assert v.extra_id(0) == v.vocab_size - 1 and v.extra_id(9) == pieces
  # Lossless: newlines, runs of spaces, tabs and characters never seen in training come back.
  docs = [d.text for d in corpus.documents("validation")[:20]]
  for text in TEXTS[1:] + ["  two  spaces\r\n", "naïve café"] + docs:
    ids = v.encode(text)
    assert ids and max(ids) < pieces and min(ids) >= 3
    assert v.decode(ids) == text
    assert v.decode([0, v.extra_id(3), *ids, 1, v.extra_id(0), 0]) == text


@needs_seqio
def test_sentencepiece_ids_equal_seqio(spm_model):
  ours = SentencePieceVocabulary(spm_model, extra_ids=10)
  theirs = ours.to_seqio()
  assert theirs.vocab_size == ours.vocab_size
  # seqio names its sentinels as pieces; the same ids must carry them.
  assert theirs.tokenizer.piece_to_id("▁<extra_id_0>") == ours.extra_id(0)
  assert theirs.tokenizer.piece_to_id("▁<extra_id_9>") == ours.extra_id(9)
  for text in TEXTS + [d.text for d in corpus.documents("validation")[:20]]:
    assert list(theirs.encode(text)) == ours.encode(text)


@pytest.fixture(scope="module")
def llama_layout_spm(tmp_path_factory):
  """A SentencePiece model with SentencePiece's default ids, which Llama uses: unk 0, bos 1, eos 2, no pad."""
  d = tmp_path_factory.mktemp("llama_spm")
  text = d / "t.txt"
  text.write_text("\n".join(doc.text for doc in corpus.documents("validation")[:200]), encoding="utf-8")
  sentencepiece.SentencePieceTrainer.Train(input=str(text), model_prefix=str(d / "m"), vocab_size=400,
                                          model_type="bpe", byte_fallback=True, character_coverage=0.99,
                                          hard_vocab_limit=False, minloglevel=2)
  return str(d / "m.model")


def test_sentencepiece_model_in_another_layout_keeps_its_ids(llama_layout_spm):
  from midas_jax.data.ul2 import objectives
  p = sentencepiece.SentencePieceProcessor(model_file=llama_layout_spm)
  v = SentencePieceVocabulary(llama_layout_spm, extra_ids=104)
  pieces = p.GetPieceSize()
  assert (v.unk_id, v.bos_id, v.eos_id, v.pad_id) == (0, 1, 2, pieces)  # no pad: the first extra id
  assert not v.seqio_layout and v.base_size == pieces and v.vocab_size == pieces + 104 and v.start_id == 1
  text = "héllo wörld, naïve"  # spm's default normalization turns newlines into spaces
  assert v.encode(text) == p.encode(text) and v.decode(v.encode(text)) == text
  assert v.decode([1, *v.encode(text), 2, v.pad_id, v.extra_id(0), 0]) == text  # bos, eos, pad, sentinel, unk
  special = objectives.vocabulary_special_tokens(v)
  assert special.sentinel_ids[0] == v.vocab_size - 1 and min(special.mode_ids.values()) == pieces + 1
  assert v.appended_tokens()[:2] == ["<pad>", "<extra_id_102>"] and v.appended_tokens()[-1] == "<extra_id_0>"
  with pytest.raises(ConfigError) as e:  # pad + 100 sentinels + 3 mode tokens need 104
    objectives.vocabulary_special_tokens(SentencePieceVocabulary(llama_layout_spm, extra_ids=103))
  assert e.value.setting == "DataConfig.extra_ids" and "104" in e.value.fix
  assert v.fingerprint != SentencePieceVocabulary(llama_layout_spm, extra_ids=105).fingerprint


def _bpe_tokenizer(tmp_path, specials, config=None) -> str:
  """A byte-level BPE trained here, saved as tokenizer.json (with a tokenizer_config.json if given)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  text = tmp_path / "t.txt"
  text.write_text("\n".join(doc.text for doc in corpus.documents("validation")[:200]), encoding="utf-8")
  tok.train([str(text)], trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(tmp_path / "tokenizer.json"))
  if config is not None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  return str(tmp_path)


def test_tokenizers_vocabulary_takes_roles_from_its_config(tmp_path):
  from midas_jax.data.ul2 import objectives
  from midas_jax.data.vocab.tokenizer_json import TokenizersVocabulary
  end = "<|endoftext|>"
  directory = _bpe_tokenizer(tmp_path, ["<pad>", end], {"eos_token": end, "bos_token": {"content": end},
                                                        "unk_token": None, "pad_token": None})
  v = make_vocabulary(DataConfig(vocab="tokenizers", tokenizer=directory, extra_ids=110))
  assert isinstance(v, TokenizersVocabulary) and v.base_size == 320 and v.vocab_size == 430
  # The config names no pad, so "<pad>" (id 0) is an ordinary token and a pad is appended.
  assert (v.eos_id, v.bos_id, v.unk_id, v.pad_id) == (1, 1, None, 320)
  assert v.appended_tokens()[0] == "<midas_pad>"  # "<pad>" is taken
  text = "Hello wörld\n  two  spaces 🙂"
  ids = v.encode(text)
  assert max(ids) < 320 and v.decode(ids) == text
  assert v.encode(f"a{end}b") == [*v.encode("a"), 1, *v.encode("b")]  # a special token's text is that token
  assert v.decode([v.eos_id, *ids, v.pad_id, v.vocab_size - 1, 10_000]) == text
  assert objectives.vocabulary_special_tokens(v).sentinel_ids[:2] == (429, 428)
  assert v.special_ids()["appended"] == {"320": "<midas_pad>"} and len(v.fingerprint) == 64
  # Examples start from the tokenizer's BOS, as the model it came with was trained.
  from midas_jax.data.pipeline import Pipeline, tokenize_documents
  docs = tokenize_documents([d.text for d in corpus.documents("validation")[:50]], v)
  data = DataConfig(vocab="tokenizers", tokenizer=directory, extra_ids=110, seq_len=64, batch_size=4)
  batch = Pipeline(data, {"train": docs, "validation": docs}, v.vocab_size, v).batch(0)
  starts = (batch["positions"] == 0) & (batch["segment_ids"] > 0)
  assert v.start_id == v.bos_id == 1 and starts.sum() >= 4 and (batch["inputs"][starts] == 1).all()
  assert ByteVocabulary().start_id == 0


def test_tokenizers_vocabulary_uses_its_own_sentinels_and_usual_names(tmp_path):
  from midas_jax.data.ul2 import objectives
  sentinels = [f"<extra_id_{k}>" for k in range(100)]
  directory = _bpe_tokenizer(tmp_path, ["</s>", "<pad>", "<unk>"] + sentinels + ["[NLU]"])
  v = make_vocabulary(DataConfig(vocab="tokenizers", tokenizer=f"{directory}/tokenizer.json", extra_ids=3))
  assert (v.eos_id, v.pad_id, v.unk_id, v.bos_id, v.reserved_extra_ids) == (0, 1, 2, None, 0)
  special = objectives.vocabulary_special_tokens(v)
  assert special.sentinel_ids == tuple(range(3, 103)) and special.mode_ids["[NLU]"] == 103
  # The mode tokens it lacks take the top extra ids.
  assert (special.mode_ids["[NLG]"], special.mode_ids["[S2S]"]) == (v.vocab_size - 1, v.vocab_size - 2)
  with pytest.raises(ConfigError) as e:
    make_vocabulary(DataConfig(vocab="tokenizers", tokenizer=str(tmp_path / "missing.json")))
  assert e.value.setting == "DataConfig.tokenizer"
  with pytest.raises(ConfigError) as e:
    DataConfig(vocab="tokenizers")
  assert e.value.setting == "DataConfig.tokenizer"


def test_make_vocabulary(tmp_path, spm_model):
  byte = make_vocabulary(DataConfig(extra_ids=16))
  assert isinstance(byte, ByteVocabulary) and byte.vocab_size == 259 + 16
  spm = make_vocabulary(DataConfig(vocab="sentencepiece", spm_model=spm_model, extra_ids=5))
  assert isinstance(spm, SentencePieceVocabulary) and spm.extra_ids == 5
  with pytest.raises(ConfigError) as e:
    make_vocabulary(DataConfig(vocab="sentencepiece", spm_model=str(tmp_path / "missing.model")))
  assert e.value.setting == "DataConfig.spm_model" and "missing.model" in e.value.problem
  junk = tmp_path / "junk.model"
  junk.write_bytes(b"not a model")
  with pytest.raises(ConfigError) as e:
    make_vocabulary(DataConfig(vocab="sentencepiece", spm_model=str(junk)))
  assert e.value.setting == "DataConfig.spm_model"


def test_fingerprints_name_what_defines_the_ids(tmp_path, spm_model):
  """Stable across instances and paths; different for another kind, size, extra ids or model."""
  assert ByteVocabulary(128).fingerprint == ByteVocabulary(128).fingerprint != ByteVocabulary(100).fingerprint
  spm = SentencePieceVocabulary(spm_model)
  moved = tmp_path / "elsewhere.model"
  moved.write_bytes(open(spm_model, "rb").read())
  assert SentencePieceVocabulary(str(moved)).fingerprint == spm.fingerprint
  assert SentencePieceVocabulary(spm_model, extra_ids=64).fingerprint != spm.fingerprint
  (tmp_path / "t.txt").write_text("\n".join(d.text[::-1] for d in corpus.documents("validation")[:300]))
  other = train_sentencepiece([str(tmp_path / "t.txt")], str(tmp_path / "other"), vocab_size=400,
                              hard_vocab_limit=False)
  assert SentencePieceVocabulary(other).fingerprint != spm.fingerprint
  assert spm.fingerprint != ByteVocabulary(128).fingerprint
