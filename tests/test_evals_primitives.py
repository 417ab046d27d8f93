"""Evaluation instruments: generators checked by an independent interpreter, scoring on hand-made
predictions, greedy decoding against a step-by-step argmax reference, fine-tune rows and steps."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from midas_jax.data.sources import corpus
from midas_jax.data.vocab.vocabulary import ByteVocabulary
from midas_jax.errors import ConfigError
from midas_jax.evals import decoding, finetune, memorization, primitives, scoring
from midas_jax.model import Decoder, dummy_batch

VOCAB = ByteVocabulary()


# ---------------------------------------------------------------------------------------------
# An interpreter written from the documented formats, not from the generators


def interpret(prompt: str):
  """(answer, hops from the queried name to a literal) of one `...; print x ->` or `seq | copy:` line."""
  if prompt.endswith(" | copy:"):
    return prompt[:-len(" | copy:")], None
  match = re.fullmatch(r"(.*); print ([a-z]) ->", prompt)
  assert match, prompt
  env, refs = {}, {}
  for statement in match[1].split("; "):
    name, expr = statement.split("=")
    assert name not in env, f"{name} assigned twice in {prompt!r}"
    if expr.isdigit():
      env[name], refs[name] = int(expr), None
    elif len(expr) == 1:
      env[name], refs[name] = env[expr], expr  # KeyError if used before assignment
    else:
      a, op, b = expr
      env[name], refs[name] = (env[a] + env[b]) if op == "+" else (env[a] - env[b]), None
  hops, name = 0, match[2]
  while refs[name] is not None:
    name, hops = refs[name], hops + 1
  return str(env[match[2]]), hops


@pytest.mark.parametrize("task", list(primitives.TASKS))
def test_every_generated_answer_matches_an_independent_computation(task):
  examples = primitives.sample(task, 300, seed=7)
  spec = primitives.TASKS[task]
  for ex in examples:
    answer, hops = interpret(ex.prompt)
    assert ex.answer == " " + answer
    assert ex.meta["task"] == task and ex.meta["primitive"] == spec.primitive
    if spec.primitive == "variable_assignment":
      assert hops == spec.depth == ex.meta["depth"]
      literals = re.findall(r"[a-z]=(\d)", ex.prompt)
      assert len(literals) == 3 and len(set(literals)) == 3  # the chain's digit and two distinct distractors
    if task == "psm":
      assert int(answer) >= 0
    if task == "copying":
      assert 5 <= len(answer) <= 10
  assert len({e.prompt for e in examples}) == len(examples)


@pytest.mark.parametrize("task", list(primitives.TASKS))
def test_k_shot_prompts_are_deterministic_and_every_shot_is_solved_correctly(task):
  a = primitives.k_shot_questions(task, 12, 5, seed=3, encode=VOCAB.encode, max_prompt_tokens=240)
  b = primitives.k_shot_questions(task, 12, 5, seed=3, encode=VOCAB.encode, max_prompt_tokens=240)
  c = primitives.k_shot_questions(task, 12, 5, seed=4, encode=VOCAB.encode, max_prompt_tokens=240)
  assert [e.to_dict() for e in a] == [e.to_dict() for e in b]
  assert [e.prompt for e in a] != [e.prompt for e in c]
  for ex in a:
    *shots, query = ex.prompt.split("\n")
    assert len(shots) == ex.meta["shots"] == 5  # k = 5 fits the default job's 256-token context
    assert query == ex.meta["query"] and interpret(query)[0] == ex.answer[1:]
    for shot in shots:
      marker = " | copy:" if task == "copying" else " ->"
      head, _, tail = shot.partition(marker)
      assert shot != query + ex.answer and interpret(head + marker)[0] == tail[1:]


def test_prompts_that_do_not_fit_drop_their_first_shots_or_fail_clearly():
  full = primitives.k_shot_questions("assignment_depth2", 4, 5, seed=0, encode=VOCAB.encode, max_prompt_tokens=1000)
  short = primitives.k_shot_questions("assignment_depth2", 4, 5, seed=0, encode=VOCAB.encode, max_prompt_tokens=100)
  for f, s in zip(full, short):
    assert len(VOCAB.encode(s.prompt)) <= 100 and 0 < s.meta["shots"] < 5
    assert f.prompt.endswith(s.prompt)  # the last shots and the query are kept
  with pytest.raises(ConfigError, match="DataConfig.seq_len"):
    primitives.k_shot_questions("assignment_depth2", 2, 5, seed=0, encode=VOCAB.encode, max_prompt_tokens=20)


def test_memorization_questions_ask_the_worlds_facts():
  world = corpus.world(0)
  sets = memorization.questions(40, seed=1)
  closed, open_, counter = (sets[c] for c in memorization.CONDITIONS)
  assert len(closed) == len(open_) == len(counter) == 40
  for c, o, x in zip(closed, open_, counter):
    entity, attribute = c.meta["entity"], c.meta["attribute"]
    assert c.prompt == corpus.question(entity, attribute) and c.answer == " " + world.value(entity, attribute)
    statement, question = o.prompt.split("\n")
    assert question == c.prompt and o.answer == c.answer and entity in statement and c.answer[1:] in statement
    statement, question = x.prompt.split("\n")
    assert question == c.prompt and x.answer != c.answer and x.answer[1:] in statement
    assert x.answer[1:] in world.choices[attribute]
  assert memorization.questions(40, seed=1) == sets


# ---------------------------------------------------------------------------------------------
# Scoring


@pytest.mark.parametrize("prediction, answer, match", [
    (" 41.", " 41", True),            # a sentence's period
    ("41\nQ: How old", " 41", True),  # only the first line counts
    ("  7  \n", " 7", True),
    (" k3#q  8z", " k3#q 8z", True),  # inner whitespace runs collapse
    (" 4", " 41", False),
    (" 411", " 41", False),
    ("", " 5", False),
    (" K3#q", " k3#q", False),        # case counts
    (" 41..", " 41", False),          # only one period is dropped
    ("\n 41", " 41", False),          # an empty first line is an empty answer
    (" 7 8", " 78", False),
])
def test_exact_match_on_hand_made_predictions(prediction, answer, match):
  assert scoring.exact_match(prediction, answer) is match


def test_a_completion_counts_only_if_its_line_ended():
  examples = [primitives.Question("p ->", " 5"), primitives.Question("p ->", " 5"), primitives.Question("p ->", " 5")]
  completions = [decoding.Completion(" 5\n", (), True), decoding.Completion(" 5", (), False),
                 decoding.Completion(" 6\n", (), True)]
  records = scoring.score(examples, completions)
  assert [r["correct"] for r in records] == [True, False, False]
  wilson = [pytest.approx(0.0615, abs=1e-4), pytest.approx(0.7923, abs=1e-4)]  # 1 of 3
  assert scoring.summarize(records) == {"accuracy": pytest.approx(1 / 3), "correct": 1, "total": 3,
                                       "accuracy_ci95": wilson, "majority_share": 1.0, "distinct_predictions": 2}


# ---------------------------------------------------------------------------------------------
# Decoding


@pytest.fixture(scope="module")
def random_model():
  # A wide init spreads the logits, so argmax has no near ties between differently padded programs.
  cfg = tiny_model(init_std=1.0, max_seq_len=128).with_vocab(VOCAB.vocab_size)
  params = jax.jit(Decoder(cfg).init)(jax.random.key(3), dummy_batch(1, 8))["params"]
  return cfg, jax.tree.map(np.asarray, nn.unbox(params))


REFERENCE_LENGTH = 32


@functools.lru_cache(maxsize=None)
def _reference_forward(cfg):
  return jax.jit(lambda params, batch: Decoder(cfg).apply({"params": params}, batch))


def reference_greedy(cfg, params, prompt, steps):
  """Step-by-step argmax, one forward of the plain causal model per token: no segment ids, no batching.

  The sequence is zero-filled to a fixed length (one compile); causal attention keeps the logits at
  the last real position independent of what follows it.
  """
  ids = list(prompt)
  for _ in range(steps):
    tokens = np.zeros((1, REFERENCE_LENGTH), np.int32)
    tokens[0, :len(ids)] = ids
    batch = dict(dummy_batch(1, REFERENCE_LENGTH), inputs=jnp.asarray(tokens))
    ids.append(int(np.argmax(_reference_forward(cfg)(params, batch)[0, len(ids) - 1])))
  return ids[len(prompt):]


def test_batched_greedy_decoding_matches_a_step_by_step_argmax(random_model):
  cfg, params = random_model
  prompts = [VOCAB.encode(t) for t in ("a=1; print a ->", "xy", "copy this | copy:", "q", "hello world, again")]
  steps = 6
  expected = [reference_greedy(cfg, params, p, steps) for p in prompts]
  # Stop on the token prompt 0 writes third, so that row ends early and the others may not.
  stop = expected[0][2]
  budgets = [steps, steps, 4, steps, 2]  # rows stop at their own budget
  out = decoding.greedy_decode(params, cfg, prompts, budgets, [stop], max_length=64, batch_size=2)
  for ref, budget, (ids, ended) in zip(expected, budgets, out):
    ref = ref[:budget]
    cut = ref.index(stop) + 1 if stop in ref else budget
    assert ids == ref[:cut] and ended == (stop in ref)
  assert out[0][0] == expected[0][:3] and out[0][1]
  assert len(out[4][0]) <= 2


def test_decoding_stops_when_the_context_is_full(random_model):
  cfg, params = random_model
  prompt = VOCAB.encode("0123456789")
  ids, ended = decoding.greedy_decode(params, cfg, [prompt], [6], [], max_length=13)[0]
  assert ids == reference_greedy(cfg, params, prompt, 3) and not ended
  with pytest.raises(ValueError, match="prompts must have"):
    decoding.greedy_decode(params, cfg, [prompt], [4], [], max_length=8)


def test_stop_tokens_of_the_byte_vocabulary_are_newline_and_eos():
  assert decoding.stop_token_ids(VOCAB) == tuple(sorted({VOCAB.eos_id, VOCAB.encode("\n")[0]}))


# ---------------------------------------------------------------------------------------------
# Fine-tuning


def test_finetune_rows_weight_exactly_the_answer_and_its_newline():
  examples = primitives.sample("assignment_depth1", 5, seed=0)
  rows = finetune.training_rows(VOCAB, examples)
  assert rows["inputs"].shape[1] % finetune.ROW_BUCKET == 0
  for i, ex in enumerate(examples):
    weighted = rows["targets"][i][rows["loss_weights"][i] > 0]
    assert VOCAB.decode(weighted) == ex.answer + "\n"
    n = int(rows["segment_ids"][i].sum())
    text = VOCAB.decode(rows["inputs"][i][:n]) + VOCAB.decode(rows["targets"][i][n - 1:n])
    assert text == ex.prompt + ex.answer + "\n"


def test_finetune_lowers_the_answer_loss():
  cfg = tiny_model().with_vocab(VOCAB.vocab_size)
  params = nn.unbox(jax.jit(Decoder(cfg).init)(jax.random.key(0), dummy_batch(1, 8))["params"])
  rows = finetune.training_rows(VOCAB, primitives.sample("assignment_depth0", 8, seed=0))
  _, losses = finetune.finetune(params, cfg, rows, steps=25, batch_size=8, learning_rate=1e-2, seed=0)
  assert len(losses) == 25 and losses[-1] < 0.5 * losses[0]
