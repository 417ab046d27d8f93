"""Reasoning primitives (MIDAS paper, Section 5) as text prompts with exact answers, and their k-shot suite.

The paper names the primitives (induction copying, variable assignment at depth 0, 1 and 2, pre-school
math) but publishes no templates, so these formats are ours. They use the notation of the built-in
corpus (data/sources/corpus.py), whose training split has lines of every one of these forms, so a model
trained on it knows the notation; the questions themselves are held out: evaluation questions are
drawn only among the prompts `corpus.is_held_out` keeps out of the training split, fine-tuning
examples only among the others:

  task               prompt                                   answer
  copying            `k3#q8z | copy:`                          ` k3#q8z`  (5 to 10 random symbols)
  assignment_depth0  `k=2; a=5; m=7; print a ->`               ` 5`
  assignment_depth1  `a=5; k=2; b=a; m=7; print b ->`          ` 5`       (one hop of indirection)
  assignment_depth2  `a=5; b=a; k=2; m=7; c=b; print c ->`     ` 5`       (two hops)
  psm                `k=1; b=4; a=3; c=a+b; print c ->`        ` 7`       (add or subtract two digits)

Variable assignment: one chain of `depth` hops from a literal digit plus two distractor literals,
with three distinct digits and distinct one-letter names; the statements are shuffled, the chain
keeping its order, so the query can only be answered by following it. Pre-school math: two operand
literals and one distractor in random order, then the sum or difference (never negative).

Every prompt ends on its answer marker and every answer starts with a space, so "prompt + answer"
is exactly the text a model trained on the corpus saw (tokenizers that merge a space into the next
piece see the same pieces). A k-shot prompt is k solved examples of the task, one per line, then
the query; decoding stops at the end of the line and scoring is exact match (scoring.py).
Everything is a pure function of (task, seed, index).

`candidates(question)` lists the answers a forced choice weighs against each other (primitive_scores.py):
the distinct digits of the prompt for assignment (the value and its two distractors), the integers
within CANDIDATE_RADIUS of the result for pre-school math, and for copying the true sequence
against NUM_SHUFFLES shuffles of its own symbols.
"""

from __future__ import annotations

import dataclasses
import random
import re
import string
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence

from midas_jax.data.sources.corpus import is_held_out, math_question
from midas_jax.errors import ConfigError, require
from midas_jax.evals import decoding, figures, scoring
from midas_jax.evals.options import context_length, option

COPY_SYMBOLS = string.ascii_lowercase + string.digits + "#@%&*+"
COPY_LENGTHS = (5, 10)
NAMES = string.ascii_lowercase
NUM_DISTRACTORS = 2
CANDIDATE_RADIUS = 2  # pre-school math: the result and its neighbours within 2 (none negative)
NUM_SHUFFLES = 2  # copying: the true sequence against two shuffles of its symbols
STREAMS = ("eval", "finetune")


@dataclasses.dataclass(frozen=True)
class Question:
  """One question: the model reads `prompt` and should write `answer` (then end the line)."""

  prompt: str
  answer: str
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def to_dict(self) -> Dict[str, Any]:
    return {"prompt": self.prompt, "answer": self.answer, "meta": dict(self.meta)}


class Task(NamedTuple):
  primitive: str
  depth: Optional[int]
  make: Callable[[random.Random], Question]


def _interleave(rng: random.Random, ordered: List[str], others: List[str]) -> List[str]:
  """A random merge of two lists that keeps `ordered` in order."""
  total = len(ordered) + len(others)
  slots = set(rng.sample(range(total), len(others)))
  ordered_it, others_it = iter(ordered), iter(others)
  return [next(others_it) if i in slots else next(ordered_it) for i in range(total)]


def make_copying(rng: random.Random) -> Question:
  length = rng.randint(*COPY_LENGTHS)
  seq = "".join(rng.choices(COPY_SYMBOLS, k=length))
  return Question(f"{seq} | copy:", f" {seq}", {"length": length})


def make_assignment(rng: random.Random, depth: int) -> Question:
  names = rng.sample(NAMES, depth + 1 + NUM_DISTRACTORS)
  chain, distractors = names[:depth + 1], names[depth + 1:]
  values = rng.sample(range(10), 1 + NUM_DISTRACTORS)
  statements = [f"{chain[0]}={values[0]}"] + [f"{b}={a}" for a, b in zip(chain, chain[1:])]
  noise = [f"{d}={v}" for d, v in zip(distractors, values[1:])]
  program = _interleave(rng, statements, noise)
  return Question("; ".join(program) + f"; print {chain[-1]} ->", f" {values[0]}", {"depth": depth})


def make_psm(rng: random.Random) -> Question:
  prompt, result, op = math_question(rng)  # the corpus's own generator: the same notation by construction
  return Question(prompt, f" {result}", {"op": op})


TASKS: Dict[str, Task] = {
    "copying": Task("copying", None, make_copying),
    "assignment_depth0": Task("variable_assignment", 0, lambda rng: make_assignment(rng, 0)),
    "assignment_depth1": Task("variable_assignment", 1, lambda rng: make_assignment(rng, 1)),
    "assignment_depth2": Task("variable_assignment", 2, lambda rng: make_assignment(rng, 2)),
    "psm": Task("pre_school_math", None, make_psm),
}


def candidates(question: Question) -> List[str]:
  """The answers a forced choice weighs, the true one first; none is a prefix of another.

  Computed from the query (meta["query"] for a k-shot question, else the prompt) and the answer.
  """
  task = question.meta["task"]
  query = question.meta.get("query", question.prompt)
  truth = question.answer
  if task == "copying":
    rng = random.Random(f"midas-evals/candidates/{query}")
    seq, shuffles = truth[1:], []
    for _ in range(100):  # a sequence of one repeated symbol has no distinct shuffle
      mixed = "".join(rng.sample(seq, len(seq)))
      if mixed != seq and mixed not in shuffles:
        shuffles.append(mixed)
      if len(shuffles) == NUM_SHUFFLES:
        break
    return [truth] + [f" {s}" for s in shuffles]
  if task == "psm":
    result = int(truth)
    near = range(max(result - CANDIDATE_RADIUS, 0), result + CANDIDATE_RADIUS + 1)
    return [truth] + [f" {n}" for n in near if n != result]
  digits = sorted(set(re.findall(r"=(\d)\b", query)))  # the literals of the program
  return [truth] + [f" {d}" for d in digits if f" {d}" != truth]


def _task(name: str) -> Task:
  if name not in TASKS:
    raise ConfigError("--tasks", f"unknown primitive task {name!r}", f"use some of {tuple(TASKS)}")
  return TASKS[name]


def sample(task: str, num: int, seed: int, stream: str = "eval", exclude: Sequence[str] = ()) -> List[Question]:
  """`num` questions of `task` with distinct prompts, none in `exclude`; a pure function of the arguments.

  `stream` names an independent random stream: "eval" draws only questions held out of the corpus's
  training split (corpus.is_held_out), "finetune" only the others.
  """
  spec = _task(task)
  require(stream in STREAMS, "stream", f"unknown stream {stream!r}", f"use one of {STREAMS}")
  rng = random.Random(f"midas-evals/{task}/{seed}/{stream}")
  seen, out = set(exclude), []
  attempts = 0
  while len(out) < num:
    attempts += 1
    if attempts > 50 * num + 200:  # one prompt in HOLD_OUT_MODULUS is held out
      raise ConfigError("--num_examples", f"cannot draw {num} distinct {task} examples",
                        "ask for fewer examples")
    ex = spec.make(rng)
    if ex.prompt in seen or is_held_out(ex.prompt) != (stream == "eval"):
      continue
    seen.add(ex.prompt)
    out.append(Question(ex.prompt, ex.answer, dict(ex.meta, task=task, primitive=spec.primitive,
                                                  depth=spec.depth)))
  return out


def shots_for(task: str, query: Question, k: int, seed: int, index: int) -> List[Question]:
  """k solved examples for query `index`: distinct, and none is the query itself."""
  spec = _task(task)
  rng = random.Random(f"midas-evals/{task}/{seed}/shots/{index}")
  shots: List[Question] = []
  while len(shots) < k:
    ex = spec.make(rng)
    if ex.prompt != query.prompt and all(ex.prompt != s.prompt for s in shots):
      shots.append(ex)
  return shots


def k_shot_prompt(query: Question, shots: Sequence[Question]) -> str:
  return "".join(s.prompt + s.answer + "\n" for s in shots) + query.prompt


def k_shot_questions(task: str, num: int, k: int, seed: int, encode: Callable[[str], List[int]],
                     max_prompt_tokens: int) -> List[Question]:
  """`num` k-shot questions; when a prompt is longer than max_prompt_tokens its first shots are dropped.

  meta["shots"] records how many shots each prompt kept. A query that does not fit even without
  shots is an error: the model's context is too short for the task.
  """
  require(k >= 0, "--k_shot", f"must be >= 0, got {k}", "5 is the paper's setting")
  out = []
  for i, query in enumerate(sample(task, num, seed)):
    shots = shots_for(task, query, k, seed, i)
    while shots and len(encode(k_shot_prompt(query, shots))) > max_prompt_tokens:
      shots = shots[1:]
    prompt = k_shot_prompt(query, shots)
    if len(encode(prompt)) > max_prompt_tokens:
      raise ConfigError("DataConfig.seq_len", f"a {task} question ({len(encode(prompt))} tokens) does not fit "
                        f"the {max_prompt_tokens} tokens left for prompts", "evaluate a model with a longer seq_len")
    out.append(Question(prompt, query.answer, dict(query.meta, shots=len(shots), query=query.prompt)))
  return out


# ---------------------------------------------------------------------------------------------
# The k-shot suite


def task_names(options: Mapping[str, Any]) -> List[str]:
  names = list(options.get("tasks") or TASKS)
  for name in names:
    _task(name)
  return names


def evaluate_k_shot(params, model_config, vocab, context_len: int, options: Mapping[str, Any]) -> Dict[str, Any]:
  """Greedy k-shot accuracy per task of one model (parameters + config); shared with the looping suite."""
  k, num, seed = option(options, "k_shot"), option(options, "num_examples"), option(options, "seed")
  per_task, examples = {}, []
  for name in task_names(options):
    budget = max(decoding.answer_budget(vocab, e) for e in sample(name, num, seed))
    per_task[name] = k_shot_questions(name, num, k, seed, vocab.encode, context_len - budget)
    examples += per_task[name]
  completions = decoding.complete(params, model_config, vocab, [e.prompt for e in examples],
                                  [decoding.answer_budget(vocab, e) for e in examples], max_length=context_len,
                                  batch_size=option(options, "batch_size"))
  records = scoring.score(examples, completions)
  out = {}
  for name, tagged in per_task.items():
    mine = [r for r in records if r["meta"]["task"] == name]
    spec = TASKS[name]
    out[name] = dict(scoring.summarize(mine), primitive=spec.primitive, depth=spec.depth,
                     shots_truncated=sum(e.meta["shots"] < k for e in tagged),
                     samples=mine[:option(options, "samples")])
  return out


def run_suite(model, workdir: str, out_dir: str, options: Mapping[str, Any]) -> Dict[str, Any]:
  """`primitives`: k-shot exact-match accuracy of greedy decoding per primitive and depth."""
  del workdir
  start = time.time()
  context_len = context_length(model)
  tasks = evaluate_k_shot(model.params, model.model_config, model.vocab, context_len, options)
  figure = figures.bar_chart(f"{out_dir}/primitives.png", {n: t["accuracy"] for n, t in tasks.items()},
                            title=f"{option(options, 'k_shot')}-shot accuracy (step {model.step}, "
                                  f"depth {model.model_config.num_layers})")
  return {"k_shot": option(options, "k_shot"), "num_examples": option(options, "num_examples"),
          "seed": option(options, "seed"), "context_len": context_len, "tasks": tasks,
          "figures": [figure], "eval_seconds": round(time.time() - start, 1)}
