"""Memorization's scores read off teacher-forced passes, comparable with the primitives' scores.

The `memorization` suite decodes and takes exact match, which stays near 0 at small scale and costs a
decoding loop. This scores the same questions (memorization.questions: closed book, open book, open
book counterfactual; zero-shot, in the corpus's own `Q: ... A:` format) with primitive_scores.py's four
scores, so a study can set reasoning beside memorization at matched loss with one yardstick:

  score            per question
  log_likelihood   mean log-probability (nats) per token of the answer (` 41`) after the prompt
  forced_choice    1 if the answer's total log-probability is above every other value the attribute
                   can take (corpus.world(...).choices[attribute]); chance 1 / len(choices)
  token_accuracy   share of the answer's tokens that are the argmax given the true prefix
  exact_match      every answer token is the argmax and the argmax after them ends the answer: the
                   corpus's period (`A: 41.`), a line end or EOS

The candidates of a question are all values of its attribute, its answer first: under
open_book_counterfactual the answer is the value the context states, not the world's, and `recalled`
counts the questions where the world's value outscored every other candidate instead (recall winning
over reading). Chance levels, intervals and the rows that share one pass are primitive_scores.py's;
the passes are continuations.py's, the scorer every suite uses.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

import numpy as np

from midas_jax.configs import ModelConfig
from midas_jax.data.sources import corpus
from midas_jax.errors import require
from midas_jax.evals import continuations, memorization, primitive_scores, scoring
from midas_jax.evals.decoding import stop_token_ids
from midas_jax.evals.options import option
from midas_jax.evals.primitive_scores import TokenizedQuestion

SCORES = primitive_scores.SCORES


def answer_end_ids(vocab) -> Tuple[int, ...]:
  """Tokens that end an answer where the corpus writes one (` 41.`): a period, a line end, EOS."""
  periods = {i for i in range(vocab.vocab_size) if vocab.decode([i]).startswith(".")}
  return tuple(sorted(periods.union(stop_token_ids(vocab))))


def build_questions(num: int, seed: int, vocab, corpus_seed: int = 0) -> Dict[str, List[TokenizedQuestion]]:
  """Per condition, memorization.questions(num, seed, corpus_seed) tokenized, with every value of the
  question's attribute as a candidate, the condition's answer first."""
  choices = corpus.world(corpus_seed).choices
  out: Dict[str, List[TokenizedQuestion]] = {}
  for condition, questions in memorization.questions(num, seed, corpus_seed).items():
    out[condition] = [
        TokenizedQuestion(q, vocab.encode(q.prompt),
                          [vocab.encode(c) for c in candidates(q.answer, choices[q.meta["attribute"]])])
        for q in questions]
  return out


def candidates(answer: str, values) -> List[str]:
  """The answer, then every other value as the corpus writes it after `A:` (a leading space)."""
  return [answer] + [f" {v}" for v in values if f" {v}" != answer]


def question_scores(params, model_config: ModelConfig, vocab, context_len: int, options: Mapping[str, Any],
                    corpus_seed: int = 0) -> Dict[str, List[Tuple[TokenizedQuestion, Dict[str, Any]]]]:
  """Per condition: each question with its scores (primitive_scores.score_question's, with
  `candidate_logprobs` in candidates' order). `score_examples` questions, drawn with `seed`."""
  num = option(options, "score_examples")
  require(num >= 1, "score_examples", f"asks for {num} questions", "pass --opt=score_examples=N with N >= 1")
  per_condition = build_questions(num, option(options, "seed"), vocab, corpus_seed)
  questions = [q for qs in per_condition.values() for q in qs]
  rows = primitive_scores.plan_rows(questions)
  longest = max((len(c) + len(t) for c, t in rows), default=0)
  require(longest <= context_len, "DataConfig.seq_len",
          f"a memorization question and its longest candidate take {longest} tokens; the model is evaluated "
          f"at {context_len}", f"evaluate a model trained on rows of at least {longest} tokens")
  logps = continuations.logprobs(params, model_config, rows, context_len, option(options, "batch_size"))
  ends = answer_end_ids(vocab)
  return {condition: [(q, primitive_scores.score_question(q, logps, rows, ends)) for q in qs]
          for condition, qs in per_condition.items()}


def recalled(scored: List[Tuple[TokenizedQuestion, Dict[str, Any]]], vocab) -> Dict[str, Any]:
  """Share of counterfactual questions whose world value outscored every other candidate."""
  hits = 0
  for q, s in scored:
    world = vocab.encode(f" {q.question.meta['world_value']}")
    totals = s["candidate_logprobs"]
    i = q.candidates.index(world)
    hits += totals[i] > max(t for j, t in enumerate(totals) if j != i)
  lo, hi = scoring.wilson_interval(hits, len(scored))
  return {"value": hits / len(scored) if scored else 0.0, "ci95": [lo, hi],
          "chance": float(np.mean([1 / len(q.candidates) for q, _ in scored])) if scored else 0.0}


def evaluate(params, model_config: ModelConfig, vocab, context_len: int, options: Mapping[str, Any],
             corpus_seed: int = 0) -> Dict[str, Any]:
  """The four scores per memorization condition of one model (parameters + config), shaped as
  primitive_scores.evaluate's per task: {"conditions": {condition: {"scores": {score: {"value", "ci95",
  "chance"}}, "questions", "mean_candidates", "samples"}}, "rows"}; the counterfactual adds `recalled`."""
  per_condition = question_scores(params, model_config, vocab, context_len, options, corpus_seed)
  out: Dict[str, Any] = {}
  for condition, scored in per_condition.items():
    qs, scores = [q for q, _ in scored], [s for _, s in scored]
    samples = [{"prompt": q.question.prompt, "answer": q.question.answer,
                "candidate_logprobs": [round(v, 3) for v in s["candidate_logprobs"]]}
               for q, s in scored[:option(options, "samples")]]
    out[condition] = dict(primitive_scores.summarize_task(scores, qs), samples=samples)
    if condition == "open_book_counterfactual":
      out[condition]["recalled"] = recalled(scored, vocab)
  rows = sum(len(q.rows) for scored in per_condition.values() for q, _ in scored)
  return {"conditions": out, "rows": rows}
