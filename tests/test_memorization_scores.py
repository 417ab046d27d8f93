"""Memorization's teacher-forced scores: candidates are the attribute's values with the condition's answer
first, forced choice is the argmax of totals computed apart, chance is the mean of 1 / choices, and
models that recall or read score under each condition as they must."""

import math
import re

import numpy as np
import pytest

from conftest import random_decoder
from midas_jax.data.sources import corpus
from midas_jax.data.vocab.vocabulary import ByteVocabulary
from midas_jax.errors import ConfigError
from midas_jax.evals import continuations, memorization, memorization_scores

VOCAB = ByteVocabulary()
WORLD = corpus.world(0)
OPTIONS = {"k_shot": 5, "score_examples": 6, "seed": 0, "tasks": None, "batch_size": 16}  # as the study passes


@pytest.fixture(scope="module")
def random_model():
  return random_decoder(VOCAB.vocab_size)


def stated_value(prompt: str, attribute: str):
  """The value the context's statement gives (read with the statement's template), or None."""
  lines = prompt.split("\n")
  if len(lines) < 2:
    return None
  pattern = re.escape(memorization.STATEMENTS[attribute]).replace(r"\{e\}", "(.+)").replace(r"\{v\}", "(.+)")
  return re.fullmatch(pattern, lines[0])[2]


def test_candidates_are_the_attributes_values_with_the_conditions_answer_first():
  built = memorization_scores.build_questions(8, 3, VOCAB)
  plain = memorization.questions(8, 3)
  assert set(built) == set(memorization.CONDITIONS)
  for condition in memorization.CONDITIONS:
    for q, p in zip(built[condition], plain[condition], strict=True):
      entity, attribute = q.question.meta["entity"], q.question.meta["attribute"]
      assert q.context == VOCAB.encode(p.prompt)  # zero-shot, the suite's own prompt
      decoded = [VOCAB.decode(c) for c in q.candidates]
      assert sorted(decoded) == sorted(f" {v}" for v in WORLD.choices[attribute])
      if condition == "open_book_counterfactual":
        assert decoded[0] == f" {stated_value(p.prompt, attribute)}" != f" {WORLD.value(entity, attribute)}"
      else:
        assert decoded[0] == f" {WORLD.value(entity, attribute)}"


def test_forced_choice_is_the_argmax_of_totals_scored_apart(random_model):
  cfg, params = random_model
  scored = memorization_scores.question_scores(params, cfg, VOCAB, 128, OPTIONS)
  result = memorization_scores.evaluate(params, cfg, VOCAB, 128, OPTIONS)
  questions = [q for pairs in scored.values() for q, _ in pairs]
  flat = [t for t, _ in continuations.totals(params, cfg, [(q.context, c) for q in questions for c in q.candidates],
                                             128, batch_size=64)]
  outcomes = []
  for condition, pairs in scored.items():
    wins = []
    for q, s in pairs:
      apart, flat = flat[:len(q.candidates)], flat[len(q.candidates):]
      np.testing.assert_allclose(s["candidate_logprobs"], apart, atol=1e-3)
      wins.append(float(int(np.argmax(apart)) == 0))
      assert s["forced_choice"] == wins[-1]
      answer = apart[0] / len(q.candidates[0])
      assert s["log_likelihood"] == pytest.approx(answer, abs=1e-4)  # per answer token
    assert result["conditions"][condition]["scores"]["forced_choice"]["value"] == pytest.approx(np.mean(wins))
    assert result["conditions"][condition]["questions"] == OPTIONS["score_examples"]
    outcomes += wins
  assert 0 < sum(outcomes) < len(outcomes)  # the random model gets some right and some wrong


def test_chance_is_the_mean_of_one_over_the_choices(random_model):
  cfg, params = random_model
  result = memorization_scores.evaluate(params, cfg, VOCAB, 128, dict(OPTIONS, score_examples=9, seed=4))
  attributes = [q.meta["attribute"] for q in memorization.questions(9, 4)["closed_book"]]
  expected = np.mean([1 / len(WORLD.choices[a]) for a in attributes])
  assert len(set(attributes)) > 1  # a mean over different choice counts
  for condition in memorization.CONDITIONS:
    got = result["conditions"][condition]
    assert got["scores"]["forced_choice"]["chance"] == pytest.approx(expected)
    assert got["mean_candidates"] == pytest.approx(np.mean([len(WORLD.choices[a]) for a in attributes]))
  assert result["conditions"]["open_book_counterfactual"]["recalled"]["chance"] == pytest.approx(expected)


QUESTIONS = {corpus.question(e, a): (e, a) for e in WORLD.entities for a in corpus.ATTRIBUTES}


def fake_scorer(favored):
  """continuations.logprobs of a model that puts nearly all its mass on favored(prompt) + "." after the
  prompt, token by token while the prefix agrees, and spreads it evenly otherwise."""
  def logprobs(params, cfg, rows, max_length, batch_size=None):
    del params, cfg, max_length, batch_size
    out = []
    for context, continuation in rows:
      prompt = VOCAB.decode(context)
      value = favored(prompt, *QUESTIONS[prompt.split("\n")[-1]])
      target = VOCAB.encode(f" {value}.") if value is not None else []
      logits = np.zeros((len(continuation) + 1, VOCAB.vocab_size))
      for j in range(len(continuation) + 1):
        if j < len(target) and list(continuation[:j]) == target[:j]:
          logits[j, target[j]] = 20.0
      out.append(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    return out
  return logprobs


def recaller(prompt, entity, attribute):
  del prompt
  return WORLD.value(entity, attribute)


def reader(prompt, entity, attribute):
  del entity
  return stated_value(prompt, attribute)


def scores_of(monkeypatch, favored):
  monkeypatch.setattr(continuations, "logprobs", fake_scorer(favored))
  result = memorization_scores.evaluate(None, None, VOCAB, 128, dict(OPTIONS, score_examples=12))
  return {c: {name: s["value"] for name, s in r["scores"].items()} for c, r in result["conditions"].items()}, \
      result["conditions"]["open_book_counterfactual"]["recalled"]["value"]


def test_a_model_that_recalls_the_world_scores_closed_and_open_book_not_the_counterfactual(monkeypatch):
  scores, recalled = scores_of(monkeypatch, recaller)
  for condition in ("closed_book", "open_book"):
    assert scores[condition]["forced_choice"] == scores[condition]["exact_match"] == 1.0
    assert scores[condition]["token_accuracy"] == 1.0
    assert scores[condition]["log_likelihood"] > -1e-6
  assert scores["open_book_counterfactual"]["forced_choice"] == 0.0 and recalled == 1.0
  assert scores["open_book_counterfactual"]["log_likelihood"] < -math.log(VOCAB.vocab_size) / 2


def test_a_model_that_reads_the_context_scores_both_open_books_and_never_recalls(monkeypatch):
  scores, recalled = scores_of(monkeypatch, reader)
  for condition in ("open_book", "open_book_counterfactual"):
    assert scores[condition]["forced_choice"] == scores[condition]["exact_match"] == 1.0
  assert recalled == 0.0
  assert scores["closed_book"]["token_accuracy"] < 1.0  # nothing to read: no favored answer


def test_a_context_too_short_for_the_questions_names_the_setting(random_model):
  cfg, params = random_model
  with pytest.raises(ConfigError, match="DataConfig.seq_len"):
    memorization_scores.evaluate(params, cfg, VOCAB, 40, OPTIONS)
  with pytest.raises(ConfigError, match="score_examples"):
    memorization_scores.evaluate(params, cfg, VOCAB, 128, dict(OPTIONS, score_examples=0))
