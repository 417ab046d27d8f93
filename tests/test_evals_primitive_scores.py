"""The early-moving primitive scores: candidates, teacher-forced log-probs against an unpadded reference,
the one-row coverage of candidates, strict exact match against greedy decoding, and the intervals."""

import functools
import math

import jax
import numpy as np
import pytest

from conftest import random_decoder
from midas_jax.data.vocab.vocabulary import ByteVocabulary
from midas_jax.evals import continuations, decoding, primitive_scores, primitives, scoring
from midas_jax.model import Decoder, dummy_batch

VOCAB = ByteVocabulary()


@pytest.fixture(scope="module")
def random_model():
  return random_decoder(VOCAB.vocab_size)


REFERENCE_LENGTH = 128


@functools.lru_cache(maxsize=None)
def _forward(cfg):
  return jax.jit(lambda params, batch: jax.nn.log_softmax(Decoder(cfg).apply({"params": params}, batch), axis=-1))


def reference_logprobs(cfg, params, context, continuation):
  """log-softmax predicting each continuation token (and the one after) from a plain causal forward of
  one row (no segment ids, no batching); zeros after the row cannot change earlier positions."""
  ids = list(context) + list(continuation)
  tokens = np.zeros((1, REFERENCE_LENGTH), np.int32)
  tokens[0, :len(ids)] = ids
  logp = np.asarray(_forward(cfg)(params, dict(dummy_batch(1, REFERENCE_LENGTH), inputs=tokens)))[0]
  return logp[len(context) - 1:len(ids)]


@pytest.mark.parametrize("task", list(primitives.TASKS))
def test_candidates_are_the_documented_sets(task):
  for ex in primitives.sample(task, 60, seed=2):
    cands = primitives.candidates(ex)
    assert cands[0] == ex.answer and len(set(cands)) == len(cands) >= 3
    assert not any(a != b and b.startswith(a) for a in cands for b in cands)  # no candidate prefixes another
    if task == "copying":
      assert all(sorted(c) == sorted(ex.answer) for c in cands) and len(cands) == 1 + primitives.NUM_SHUFFLES
    elif task == "psm":
      values = [int(c) for c in cands]
      assert min(values) >= 0 and all(abs(v - values[0]) <= primitives.CANDIDATE_RADIUS for v in values)
      assert len(values) == min(values[0], 2) + 3
    else:  # the chain's value and the two distractors' values, the literals of the program
      assert sorted(c.strip() for c in cands) == sorted(set(ch for ch in ex.prompt if ch.isdigit()))


def test_teacher_forced_logprobs_match_an_unpadded_forward(random_model):
  cfg, params = random_model
  rows = [(VOCAB.encode(p), VOCAB.encode(a)) for p, a in
          [("a=1; print a ->", " 1"), ("x", " yz"), ("k3#q | copy:", " k3#q"), ("long " * 14, " 7")]]
  got = continuations.logprobs(params, cfg, rows, max_length=128, batch_size=2)
  for (context, continuation), lp in zip(rows, got):
    assert lp.shape == (len(continuation) + 1, cfg.vocab_size)
    np.testing.assert_allclose(lp, reference_logprobs(cfg, params, context, continuation), atol=2e-4)


@pytest.mark.parametrize("task", ["assignment_depth1", "psm", "copying"])
def test_one_row_scores_every_covered_candidate_as_its_own_row_would(random_model, task):
  cfg, params = random_model
  questions = primitive_scores.build_questions(task, 4, 1, 0, VOCAB, 128)
  rows = primitive_scores.plan_rows(questions)
  logps = continuations.logprobs(params, cfg, rows, 128)
  if task == "assignment_depth1":
    assert len(rows) == len(questions)  # digits differ only in their last token: one row each
  if task == "copying":
    assert len(rows) == 3 * len(questions)
  for q in questions:
    scores = primitive_scores.score_question(q, logps, rows, decoding.stop_token_ids(VOCAB))
    for cand, total in zip(q.candidates, scores["candidate_logprobs"]):
      lp = reference_logprobs(cfg, params, q.context, cand)
      assert total == pytest.approx(sum(lp[j, t] for j, t in enumerate(cand)), abs=1e-3)
    assert scores["forced_choice"] == float(np.argmax(scores["candidate_logprobs"]) == 0)


def test_strict_exact_match_is_greedy_decoding_writing_the_answer_and_ending_the_line(random_model):
  cfg, params = random_model
  prompts = [VOCAB.encode(p) for p in ("a=1; print a ->", "q", "x=3; y=4; print y ->", "hello", "copy | copy:")]
  free = decoding.greedy_decode(params, cfg, prompts, [8] * len(prompts), [], max_length=64)
  stop = (free[0][0][2],)  # the third token row 0 writes: row 0 ends there, rows without it run on
  decoded = decoding.greedy_decode(params, cfg, prompts, [8] * len(prompts), stop, max_length=64)
  assert any(ended for _, ended in decoded) and not all(ended for _, ended in decoded)
  cases = []  # (question, expected exact match, answer length), every prefix of what decoding wrote
  for prompt, (ids, ended) in zip(prompts, decoded):
    complete = ids[:-1] if ended else ids
    for k in range(1, len(complete) + 1):
      answer = complete[:k]
      wrong = answer[:-1] + [(answer[-1] + 1) % 256]
      question = primitives.Question("p", "a")
      cases.append((primitive_scores.TokenizedQuestion(question, prompt, [answer, wrong]),
                    float(ended and k == len(complete)), k))  # the line ends right after the answer
      cases.append((primitive_scores.TokenizedQuestion(question, prompt, [wrong, answer]), None, k))
  rows = primitive_scores.plan_rows([q for q, _, _ in cases])
  logps = continuations.logprobs(params, cfg, rows, 64)
  for q, expected, k in cases:
    scores = primitive_scores.score_question(q, logps, rows, stop)
    if expected is None:  # the wrong answer first
      assert scores["exact_match"] == 0.0 and scores["forced_choice"] == 0.0
      assert scores["token_accuracy"] == pytest.approx((k - 1) / k)
    else:
      assert scores["token_accuracy"] == 1.0 and scores["forced_choice"] == 1.0
      assert scores["exact_match"] == expected


def test_chance_levels_and_intervals_on_hand_made_cases():
  assert primitive_scores.guesser_token_accuracy([[1, 2], [1, 3], [1, 4]]) == pytest.approx((1 + 1 / 3) / 2)
  assert (primitive_scores.guesser_token_accuracy([[1, 2, 5], [1, 2, 6], [9, 9, 9]])
          == pytest.approx((2 / 3 + 1 + 0.5) / 3))
  lo, hi = scoring.wilson_interval(0, 10)
  assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
  lo, hi = scoring.wilson_interval(50, 100)
  assert (lo, hi) == (pytest.approx(0.4038, abs=1e-4), pytest.approx(0.5962, abs=1e-4))
  mean, lo, hi = scoring.mean_interval([1.0, 2.0, 3.0, 4.0])
  half = 1.959964 * math.sqrt(5 / 3) / 2
  assert (mean, lo, hi) == (2.5, pytest.approx(2.5 - half), pytest.approx(2.5 + half))
  examples = [primitives.Question("x", " 5", {"task": "assignment_depth0", "query": "a=5; b=1; c=2; print a ->"})] * 4
  questions = [primitive_scores.TokenizedQuestion(e, [1], [VOCAB.encode(c) for c in primitives.candidates(e)])
               for e in examples]
  per_question = [{"log_likelihood": -1.0, "forced_choice": 1.0, "token_accuracy": 0.5, "exact_match": 0.0}] * 4
  summary = primitive_scores.summarize_task(per_question, questions)["scores"]
  assert summary["forced_choice"]["chance"] == pytest.approx(1 / 3)
  assert summary["log_likelihood"]["chance"] == pytest.approx(math.log(1 / 3) / 2)  # " 5" is two bytes
  assert summary["token_accuracy"]["chance"] == pytest.approx((1 + 1 / 3) / 2)
  assert summary["exact_match"] == {"value": 0.0, "ci95": [0.0, pytest.approx(0.4899, abs=1e-4)], "chance": 1.0}
