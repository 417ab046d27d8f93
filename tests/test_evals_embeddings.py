"""Embedding-space measures: single-token characters, cosine matrix, PCA, group means, checkpoint choice."""

import numpy as np

from midas_jax.configs import DataConfig
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.evals import embeddings


def test_byte_vocabulary_names_every_character_as_one_token():
  chars, ids, groups = embeddings.single_token_ids(make_vocabulary(DataConfig()))
  assert chars[:10] == list("0123456789") and ids[:10] == [ord(c) + 3 for c in "0123456789"]
  assert groups.count("digits") == 10 and groups.count("lower") == 26 and groups.count("upper") == 26
  assert len(set(ids)) == len(ids)


def test_cosine_pca_and_group_means_on_known_vectors():
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal(8), rng.standard_normal(8)
  b -= a * (a @ b) / (a @ a)  # orthogonal to a
  vectors = np.stack([a, 2 * a, 0.5 * a, b, 3 * b])
  groups = ["digits"] * 3 + ["lower"] * 2
  cos = embeddings.cosine_similarities(vectors)
  sims = embeddings.group_similarity(cos, groups)
  assert sims["digits/digits"] == 1.0 and sims["lower/lower"] == 1.0 and abs(sims["digits/lower"]) < 1e-9
  coords, explained = embeddings.pca_2d(vectors)
  assert coords.shape == (5, 2) and 0.99 < sum(explained) <= 1.0 + 1e-9 and explained[0] >= explained[1]
  # Points that are scaled copies of one direction stay on one line through their own mean in the projection.
  digits = coords[:3] - coords[:3].mean(axis=0)
  assert abs(digits[0, 0] * digits[1, 1] - digits[0, 1] * digits[1, 0]) < 1e-6


def test_checkpoints_are_picked_evenly_with_the_first_and_last():
  assert embeddings.pick_steps([4, 2, 8], 6) == [2, 4, 8]
  assert embeddings.pick_steps([4, 2, 8], 1) == [8]
  picked = embeddings.pick_steps(list(range(0, 1001, 10)), 5)
  assert picked[0] == 0 and picked[-1] == 1000 and len(picked) == 5
