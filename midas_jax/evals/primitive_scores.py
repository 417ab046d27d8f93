"""Scores of the reasoning primitives that move before exact match does, read off teacher-forced passes.

Exact match of greedy decoding stays at 0 (or at the majority answer's share) until a model has
all but learned a task, so it cannot tell two small models apart. These scores can, and each is a
mean over questions with a 95% interval and the level a model with no skill gets:

  score            per question                                    chance level
  log_likelihood   mean log-probability (nats) of the answer's     log(1 / candidates) / answer tokens:
                   tokens after the k-shot prompt                  a model that knows the candidate set
                                                                   and nothing else
  forced_choice    1 if the true answer outscores every other      1 / candidates
                   candidate (primitives.candidates) by total
                   log-probability
  token_accuracy   share of answer tokens that are the argmax      the share of candidates that agree with
                   given the true prefix (teacher forcing)         the answer at each token, among those
                                                                   that agree with it before
  exact_match      1 if every answer token is the argmax and the   the most common answer's share (what a
                   token after them ends the line                  constant answer scores)

exact_match here is greedy decoding's strict form: greedy decoding writes token t+1 from the
prefix the argmax wrote, so "every answer token is the argmax, then a line end" is exactly greedy
decoding writing the answer and ending its line (the `primitives` suite's decoded exact match also
accepts a trailing period or extra spaces). Intervals: Wilson for the 0/1 scores, the normal
approximation of a mean for the others (scoring.py).

One forward pass per question scores the true answer and every candidate that differs from it only
in its last token (the prompt's other digits, neighbouring integers); other candidates get a row
of their own. The rows are scored by continuations.py, the scorer the lm-eval adapter uses too.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np

from midas_jax.configs import ModelConfig
from midas_jax.evals import continuations, figures, primitives, scoring
from midas_jax.evals.decoding import stop_token_ids
from midas_jax.evals.options import context_length, option

SCORES = ("log_likelihood", "forced_choice", "token_accuracy", "exact_match")


@dataclasses.dataclass
class TokenizedQuestion:
  """One k-shot question, tokenized: context, its candidate answers (the true one first)."""

  question: primitives.Question
  context: List[int]
  candidates: List[List[int]]
  rows: List[int] = dataclasses.field(default_factory=list)  # indices into the row list
  covered_by: List[int] = dataclasses.field(default_factory=list)  # per candidate: which of `rows`


def _covers(row: Sequence[int], candidate: Sequence[int]) -> bool:
  """A row's log-probs score a candidate if the candidate, less its last token, starts the row."""
  return len(candidate) - 1 <= len(row) and list(row[:len(candidate) - 1]) == list(candidate[:-1])


def plan_rows(questions: Sequence[TokenizedQuestion]) -> List[Tuple[List[int], List[int]]]:
  """The (context, continuation) rows to run: each question's true answer, plus every candidate no
  earlier row of its question covers. Fills each question's rows and covered_by."""
  rows: List[Tuple[List[int], List[int]]] = []
  for q in questions:
    planned: List[List[int]] = []
    for cand in q.candidates:
      hit = next((j for j, cont in enumerate(planned) if _covers(cont, cand)), None)
      if hit is None:
        planned.append(cand)
        hit = len(planned) - 1
        q.rows.append(len(rows))
        rows.append((q.context, cand))
      q.covered_by.append(hit)
  return rows


def _candidate_logprob(logp: np.ndarray, row: Sequence[int], candidate: Sequence[int]) -> float:
  prefix = sum(float(logp[i, row[i]]) for i in range(len(candidate) - 1))
  return prefix + float(logp[len(candidate) - 1, candidate[-1]])


def guesser_token_accuracy(candidates: Sequence[Sequence[int]]) -> float:
  """Teacher-forced token accuracy of guessing among the candidates that agree with the true answer
  (candidates[0]) so far: at each token, the share of them that also agree there."""
  truth = candidates[0]
  shares = []
  for j, token in enumerate(truth):
    alive = [c for c in candidates if len(c) > j and list(c[:j]) == list(truth[:j])]
    shares.append(sum(c[j] == token for c in alive) / len(alive))
  return sum(shares) / len(shares)


def score_question(q: TokenizedQuestion, logps: Sequence[np.ndarray], rows, stop_ids: Sequence[int]) -> Dict[str, Any]:
  """The four scores of one question from its rows' log-probs."""
  true_logp, answer = logps[q.rows[0]], q.candidates[0]
  token_lp = [float(true_logp[j, t]) for j, t in enumerate(answer)]
  argmax = true_logp.argmax(axis=-1)
  hits = [bool(argmax[j] == t) for j, t in enumerate(answer)]
  totals = []
  for cand, which in zip(q.candidates, q.covered_by):
    row_index = q.rows[which]
    totals.append(_candidate_logprob(logps[row_index], rows[row_index][1], cand))
  return {"log_likelihood": sum(token_lp) / len(token_lp),
          "forced_choice": float(totals[0] > max(totals[1:], default=-math.inf)),
          "token_accuracy": sum(hits) / len(hits),
          "exact_match": float(all(hits) and int(argmax[len(answer)]) in stop_ids),
          "candidate_logprobs": totals}


def summarize_task(scores: Sequence[Dict[str, Any]], questions: Sequence[TokenizedQuestion]) -> Dict[str, Any]:
  """Each score's mean, 95% interval and chance level over the task's questions."""
  n = len(scores)
  out: Dict[str, Any] = {}
  for name in SCORES:
    values = [s[name] for s in scores]
    if name in ("forced_choice", "exact_match"):
      lo, hi = scoring.wilson_interval(int(round(sum(values))), n)
      mean = sum(values) / n
    else:
      mean, lo, hi = scoring.mean_interval(values)
    out[name] = {"value": mean, "ci95": [lo, hi]}
  sizes = [len(q.candidates) for q in questions]
  out["log_likelihood"]["chance"] = float(np.mean([math.log(1 / len(q.candidates)) / len(q.candidates[0])
                                                   for q in questions]))
  out["forced_choice"]["chance"] = float(np.mean([1 / k for k in sizes]))
  out["token_accuracy"]["chance"] = float(np.mean([guesser_token_accuracy(q.candidates) for q in questions]))
  out["exact_match"]["chance"] = scoring.majority_share([q.question.answer for q in questions])
  return {"scores": out, "questions": n, "mean_candidates": float(np.mean(sizes))}


def build_questions(task: str, num: int, k: int, seed: int, vocab, context_len: int) -> List[TokenizedQuestion]:
  """`num` k-shot questions of `task` with their tokenized candidates; prompts leave room for the
  longest candidate and the token after it."""
  held = primitives.sample(task, num, seed)
  room = max(len(vocab.encode(c)) for e in held for c in primitives.candidates(e)) + 1
  questions = primitives.k_shot_questions(task, num, k, seed, vocab.encode, context_len - room)
  return [TokenizedQuestion(q, vocab.encode(q.prompt), [vocab.encode(c) for c in primitives.candidates(q)])
          for q in questions]


def evaluate(params, model_config: ModelConfig, vocab, context_len: int, options: Mapping[str, Any]) -> Dict[str, Any]:
  """The four scores per task of one model (parameters + config), for the options' tasks."""
  k, num, seed = option(options, "k_shot"), option(options, "score_examples"), option(options, "seed")
  per_task = {name: build_questions(name, num, k, seed, vocab, context_len)
              for name in primitives.task_names(options)}
  questions = [q for qs in per_task.values() for q in qs]
  rows = plan_rows(questions)
  logps = continuations.logprobs(params, model_config, rows, context_len, option(options, "batch_size"))
  stop_ids = stop_token_ids(vocab)
  out = {}
  for name, qs in per_task.items():
    scores = [score_question(q, logps, rows, stop_ids) for q in qs]
    spec = primitives.TASKS[name]
    samples = [{"prompt": q.question.meta["query"], "answer": q.question.answer,
                "candidates": primitives.candidates(q.question),
                "candidate_logprobs": [round(v, 3) for v in s["candidate_logprobs"]]}
               for q, s in zip(qs[:option(options, "samples")], scores)]
    out[name] = dict(summarize_task(scores, qs), primitive=spec.primitive, depth=spec.depth, samples=samples)
  return {"tasks": out, "rows": len(rows)}


def run_suite(model, workdir: str, out_dir: str, options: Mapping[str, Any]) -> Dict[str, Any]:
  """`primitive_scores`: log-likelihood, forced choice, token accuracy and strict exact match per primitive."""
  del workdir
  start = time.time()
  context_len = context_length(model)
  result = evaluate(model.params, model.model_config, model.vocab, context_len, options)
  tasks = result["tasks"]
  figure = figures.bar_chart(f"{out_dir}/primitive_scores.png",
                            {n: t["scores"]["forced_choice"]["value"] for n, t in tasks.items()},
                            title=f"forced choice among candidates (step {model.step}, depth "
                                  f"{model.model_config.num_layers}); dashes: chance",
                            references={n: t["scores"]["forced_choice"]["chance"] for n, t in tasks.items()})
  return {"k_shot": option(options, "k_shot"), "score_examples": option(options, "score_examples"),
          "seed": option(options, "seed"), "context_len": context_len, "tasks": tasks, "rows": result["rows"],
          "figures": [figure], "eval_seconds": round(time.time() - start, 1)}
