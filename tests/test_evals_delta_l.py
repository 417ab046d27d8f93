"""Delta L pieces: kind groups, causal-LM rows that count every target once, and the loss they give."""

import math

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import tiny_model
from midas_jax.data.sources import corpus
from midas_jax.errors import ConfigError
from midas_jax.evals import delta_l
from midas_jax.model import Decoder, dummy_batch


def test_kind_names_and_groups():
  assert delta_l.kinds_of("reasoning", "a") == ("arithmetic", "assignment")
  assert delta_l.kinds_of("facts+story", "b") == ("facts", "story")
  with pytest.raises(ConfigError, match="unknown document kind"):
    delta_l.kinds_of("poems", "a")
  docs = delta_l.builtin_documents(("arithmetic",), seed=0, limit=5)
  kinds = {d.text: d.kind for d in corpus.documents("validation", 0)}
  assert len(docs) == 5 and all(kinds[t] == "arithmetic" for t in docs)


def test_rows_count_every_target_once():
  doc = np.arange(10, 20)  # 10 tokens -> 9 targets
  rows = delta_l.loss_rows([doc, np.arange(30, 33)], seq_len=4)
  assert rows["inputs"].shape == (4, 4)  # 9 targets in rows of 4, 4, 1; then 2 targets
  w = rows["loss_weights"].astype(bool)
  assert rows["targets"][w].tolist() == list(range(11, 20)) + [31, 32]
  assert rows["inputs"][w].tolist() == list(range(10, 19)) + [30, 31]
  assert (rows["segment_ids"] == w).all()


def test_mean_loss_of_a_uniform_model_is_log_vocab():
  cfg = tiny_model().with_vocab(300)
  shapes = jax.eval_shape(lambda: nn.unbox(Decoder(cfg).init(jax.random.key(0), dummy_batch(1, 8))["params"]))
  zero = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)  # zero embeddings: every logit is 0
  rows = delta_l.loss_rows([np.arange(3, 40), np.arange(50, 61)], seq_len=16)
  assert delta_l.mean_loss(zero, cfg, rows, batch_rows=2) == pytest.approx(math.log(cfg.vocab_size), rel=1e-5)
  assert delta_l.delta_l(3.0, 2.0) == 0.5 and delta_l.delta_l(1.0, 2.0) == -0.5
