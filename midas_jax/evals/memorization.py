"""Memorization against reasoning at our scale: closed-book recall of the built-in world's facts, and
the same questions with the fact in the context (open book), the MIDAS paper's closed- vs open-book split.

The default job's model trained on facts documents about the corpus's world (data/sources/corpus.py): they
state attributes of its 300 people and ask "Q: How old is Doru? A: 41." about them. Each question
here is asked three ways, zero-shot in the corpus's own format:

  closed_book          `Q: How old is Doru? A:`                          recall from the weights
  open_book            `Doru is 41 years old.\nQ: How old is Doru? A:`    the true fact in the context
  open_book_counterfactual  the context states another value, and that is the answer: only reading
                       the context gets it right, recall gets it wrong (its `recalled` rate counts
                       answers that gave the world's value instead)

`chance` is the mean over the questions of 1 / (number of values the attribute can take), what a
model that knows the answer format but nothing else scores.
"""

from __future__ import annotations

import random
import time
from typing import Any, Dict, List, Mapping, Optional

from midas_jax.data.sources import corpus
from midas_jax.evals import decoding, figures, scoring
from midas_jax.evals.options import context_length, option
from midas_jax.evals.primitives import Question

STATEMENTS = {
    "city": "{e} lives in {v}.", "color": "The favorite color of {e} is {v}.", "job": "{e} works as a {v}.",
    "pet": "{e} has a pet {v}.", "age": "{e} is {v} years old.", "food": "The favorite food of {e} is {v}.",
}
CONDITIONS = ("closed_book", "open_book", "open_book_counterfactual")


def applies(model, options) -> Optional[str]:
  del options
  if model.config.data.source != "builtin":
    return f"the run trained on DataConfig.source={model.config.data.source!r}, not the built-in corpus's world"
  return None


def questions(num: int, seed: int, corpus_seed: int = 0) -> Dict[str, List[Question]]:
  """`num` distinct (person, attribute) questions under each condition, a pure function of the seeds."""
  world = corpus.world(corpus_seed)
  rng = random.Random(f"midas-evals/memorization/{seed}")
  pairs = [(e, a) for e in world.entities for a in corpus.ATTRIBUTES]
  out: Dict[str, List[Question]] = {c: [] for c in CONDITIONS}
  for entity, attribute in rng.sample(pairs, min(num, len(pairs))):
    value = world.value(entity, attribute)
    other = rng.choice([v for v in world.choices[attribute] if v != value])
    question = corpus.question(entity, attribute)
    meta = {"entity": entity, "attribute": attribute, "world_value": value,
            "chance": 1.0 / len(world.choices[attribute])}
    out["closed_book"].append(Question(question, f" {value}", meta))
    out["open_book"].append(Question(f"{STATEMENTS[attribute].format(e=entity, v=value)}\n{question}", f" {value}",
                                    meta))
    out["open_book_counterfactual"].append(
        Question(f"{STATEMENTS[attribute].format(e=entity, v=other)}\n{question}", f" {other}", meta))
  return out


def run_suite(model, workdir: str, out_dir: str, options: Mapping[str, Any]) -> Dict[str, Any]:
  """`memorization`: exact-match accuracy closed book, open book and open book with a counterfactual."""
  del workdir
  start = time.time()
  sets = questions(option(options, "num_examples"), option(options, "seed"), model.config.data.corpus_seed)
  examples = [e for c in CONDITIONS for e in sets[c]]
  completions = decoding.complete(model.params, model.model_config, model.vocab, [e.prompt for e in examples],
                                  [decoding.answer_budget(model.vocab, e) for e in examples],
                                  max_length=context_length(model), batch_size=option(options, "batch_size"))
  records = scoring.score(examples, completions)
  out: Dict[str, Any] = {}
  for i, condition in enumerate(CONDITIONS):
    mine = records[i * len(sets[condition]):(i + 1) * len(sets[condition])]
    out[condition] = dict(scoring.summarize(mine), samples=mine[:option(options, "samples")])
    if condition == "open_book_counterfactual":
      recalled = sum(c.ended and scoring.exact_match(c.text, f" {r['meta']['world_value']}")
                     for r, c in zip(mine, completions[i * len(mine):(i + 1) * len(mine)]))
      out[condition]["recalled"] = recalled / len(mine) if mine else 0.0
  chance = sum(e.meta["chance"] for e in sets["closed_book"]) / max(len(sets["closed_book"]), 1)
  figure = figures.bar_chart(f"{out_dir}/memorization.png", {c: out[c]["accuracy"] for c in CONDITIONS},
                            title=f"world facts (step {model.step}); chance {chance:.3f}", reference=chance)
  return dict(out, num_questions=len(sets["closed_book"]), chance=chance, figures=[figure],
              eval_seconds=round(time.time() - start, 1))
