"""The built-in corpus: determinism, sizes, mixture, disjoint splits, and answers that are right."""

import collections
import re

import pytest

from midas_jax.data.sources import corpus
from midas_jax.data.sources.corpus import ATTRIBUTES, KIND_SHARES, SIZES, documents, question, world


def _of_kind(split, kind, seed=0):
  return [d.text for d in documents(split, seed) if d.kind == kind]


def test_generation_is_deterministic_and_cheap(monkeypatch):
  # The corpus is made in the process that uses it (tests, demos, data loading), so what keeps that cheap is
  # checked, not timed: a document costs one generator call (the redraw loops stay cold), the world is built
  # once per seed, each split once (validation reuses train's to skip its texts), and later calls are cached.
  before = {s: documents(s) for s in corpus.SPLITS}
  calls = collections.Counter()
  for kind, make in dict(corpus._GENERATORS).items():
    def counted(rng, w, split, kind=kind, make=make):
      calls[split, kind] += 1
      return make(rng, w, split)
    monkeypatch.setitem(corpus._GENERATORS, kind, counted)
  corpus._documents.cache_clear()
  corpus.world.cache_clear()
  after = {s: documents(s) for s in corpus.SPLITS}
  assert after == before  # regenerated from scratch (the calls below), the same documents
  for split in corpus.SPLITS:
    for kind, count in corpus.kind_counts(split).items():
      assert count <= calls[split, kind] <= count + count // 1000 + 5, (split, kind, count, calls[split, kind])
  assert corpus.world.cache_info().misses == 1 and corpus._documents.cache_info().misses == 2
  made = sum(calls.values())
  assert [len(documents(s)) for s in corpus.SPLITS] == [SIZES[s] for s in corpus.SPLITS]
  assert sum(calls.values()) == made


def test_seeds_differ():
  assert world(1).entities != world(0).entities
  texts0 = {d.text for d in documents("validation", 0)}
  texts1 = {d.text for d in documents("validation", 1)}
  assert len(texts0 & texts1) < 10  # a few short copy/assignment lines could coincide; documents don't


def test_documents_returns_a_fresh_list():
  docs = documents("validation")
  docs.clear()
  assert len(documents("validation")) == SIZES["validation"]


def test_unknown_split():
  with pytest.raises(ValueError, match="unknown split"):
    documents("test")


@pytest.mark.parametrize("split", corpus.SPLITS)
def test_sizes_and_mixture(split):
  docs = documents(split)
  assert len(docs) == SIZES[split]
  counts = collections.Counter(d.kind for d in docs)
  assert set(counts) == {k for k, _ in KIND_SHARES}
  for kind, share in KIND_SHARES:
    assert abs(counts[kind] / len(docs) - share) < 0.01, (kind, counts[kind])
  mean_bytes = sum(len(d.text.encode()) for d in docs) / len(docs)
  assert 150 < mean_bytes < 500
  # Shuffled, not grouped by kind: every kind shows up in the first 100 documents.
  assert {d.kind for d in docs[:100]} == set(counts)


@pytest.mark.parametrize("split", corpus.SPLITS)
def test_no_blank_lines_and_no_repeats(split):
  texts = [d.text for d in documents(split)]
  assert len(set(texts)) == len(texts)
  for text in texts:
    assert text == text.strip() and text
    assert all(line.strip() for line in text.split("\n")), repr(text)


def test_validation_disjoint_from_train():
  train = {d.text for d in documents("train")}
  assert not any(d.text in train for d in documents("validation"))


# ---------------------------------------------------------------------------------------------
# Facts

def _statements(text):
  """The statement sentences of a facts document (question lines excluded)."""
  lines = [line for line in text.split("\n") if not line.startswith("Q: ")]
  return [s for line in lines for s in re.split(r"(?<=\.) ", line)]


def test_world_shape():
  w = world(0)
  assert len(w.entities) == len(set(w.entities)) == corpus.NUM_ENTITIES
  assert len(w.facts) == len(w.entities) * len(ATTRIBUTES)
  assert {(f.entity, f.attribute) for f in w.facts} == {(e, a) for e in w.entities for a in ATTRIBUTES}
  for f in w.facts:
    assert f.value in w.choices[f.attribute] and w.value(f.entity, f.attribute) == f.value
  assert not set(w.entities) & set(w.choices["city"])


def test_facts_are_true_and_every_fact_is_taught():
  w = world(0)
  names = set(w.entities)
  facts_of = collections.defaultdict(list)
  for f in w.facts:
    facts_of[f.entity].append(f)
  taught = set()
  for split in corpus.SPLITS:
    for text in _of_kind(split, "facts"):
      for sentence in _statements(text):
        words = set(re.findall(r"[A-Za-z0-9]+", sentence))
        (entity,) = words & names  # one person per sentence
        true = [f for f in facts_of[entity] if f.value in words]
        assert true, sentence
        if split == "train":
          taught.update(true)
  assert taught == set(w.facts)


def test_questions_have_the_worlds_answers():
  w = world(0)
  answers = {question(f.entity, f.attribute): f.value for f in w.facts}
  asked = 0
  for text in _of_kind("train", "facts"):
    for line in text.split("\n"):
      if line.startswith("Q: "):
        prompt, answer = line.rsplit(" ", 1)
        assert answers[prompt] + "." == answer
        asked += 1
  assert asked > 1000


def test_validation_facts_use_held_out_templates():
  train_sentences = {s for t in _of_kind("train", "facts") for s in _statements(t)}
  val_sentences = [s for t in _of_kind("validation", "facts") for s in _statements(t)]
  assert val_sentences and not any(s in train_sentences for s in val_sentences)


# ---------------------------------------------------------------------------------------------
# Reasoning

def _evaluate_assignment(line):
  """Runs `a=5; b=a; print b -> 5` or `x=3; y=4; c=x+y; print c -> 7`; returns (printed value, claimed
  value, chain depth, or "math" for a sum or difference)."""
  *statements, final = line.split("; ")
  env, depth = {}, {}
  for statement in statements:
    name, expr = statement.split("=")
    assert name not in env, line
    if expr.isdigit():
      env[name], depth[name] = int(expr), 0
    elif len(expr) == 1:
      env[name], depth[name] = env[expr], depth[expr] + 1
    else:
      a, op, b = expr
      env[name], depth[name] = (env[a] + env[b] if op == "+" else env[a] - env[b]), "math"
  target, claimed = re.fullmatch(r"print (\w) -> (\d+)", final).groups()
  return env[target], int(claimed), depth[target]


@pytest.mark.parametrize("split", corpus.SPLITS)
def test_assignment_chains_and_sums_resolve(split):
  depths = collections.Counter()
  for text in _of_kind(split, "assignment"):
    for line in text.split("\n"):
      value, claimed, depth = _evaluate_assignment(line)
      assert value == claimed >= 0, line
      depths[depth] += 1
  chains = sum(depths[d] for d in (0, 1, 2))
  assert set(depths) == {0, 1, 2, "math"} and min(depths[d] for d in (0, 1, 2)) > 0.25 * chains
  assert 0.2 < depths["math"] / sum(depths.values()) < 0.3


def _reasoning_lines(split):
  return {line for kind in ("assignment", "copy") for text in _of_kind(split, kind) for line in text.split("\n")}


def test_every_primitive_prompt_form_occurs_in_train_and_no_eval_question_does():
  """The primitives are asked in the corpus's notation (evals/primitives.py), and held out."""
  from midas_jax.evals import primitives  # pylint: disable=import-outside-toplevel
  lines = _reasoning_lines("train")
  prompts = {line.rpartition(" -> ")[0] + " ->" for line in lines if " -> " in line}
  prompts |= {line.split(" | ")[0] + " | copy:" for line in lines if " | copy: " in line}
  assert not any(corpus.is_held_out(p) for p in prompts)
  shapes = lambda p: re.sub(r"\d", "D", re.sub(r"[a-z](?=[=;+-])|(?<=[=+-])[a-z]|print [a-z]", "x", p))  # noqa: E731
  train_shapes = {shapes(p) for p in prompts if "copy" not in p}
  for task in primitives.TASKS:
    questions = primitives.sample(task, 200, seed=0)
    assert all(corpus.is_held_out(q.prompt) for q in questions)
    assert not any(q.prompt + q.answer in lines for q in questions)
    if task == "copying":
      assert any(line.endswith(": " + line.split(" | ")[0]) and " | copy: " in line for line in lines)
    else:  # the same statement pattern (names and digits abstracted) occurs in training
      assert {shapes(q.prompt) for q in questions} <= train_shapes, task
    tuned = primitives.sample(task, 50, seed=0, stream="finetune")
    assert not any(corpus.is_held_out(q.prompt) for q in tuned)


def test_held_out_rule_is_a_fixed_tenth_of_prompts():
  prompts = [f"a={i % 10}; b=a; k={i // 10 % 10}; print b ->" for i in range(100)] + \
      [f"{i:08x} | copy:" for i in range(2000)]
  share = sum(map(corpus.is_held_out, prompts)) / len(prompts)
  assert 0.07 < share < 0.13
  assert [corpus.is_held_out(p) for p in prompts] == [corpus.is_held_out(p) for p in prompts]


def _solve_word_problem(problem):
  """Computes the answer from the words alone (the numbers and the verbs), not from the worked part."""
  a, b, *rest = [int(n) for n in re.findall(r"\d+", problem)]
  if "loses" in problem:
    return a + b - rest[0]
  if "gives" in problem:
    return a - b
  if "bags with" in problem:
    return a * b
  return a + b


@pytest.mark.parametrize("split", corpus.SPLITS)
def test_arithmetic_answers_are_correct(split):
  ops = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
  for text in _of_kind(split, "arithmetic"):
    for line in text.split("\n"):
      problem = line[:line.index(". ") + 1]
      equations = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", line)
      answer = int(re.fullmatch(r".*\. Answer: (\d+)", line).group(1))
      assert equations, line
      for x, op, y, z in equations:
        assert ops[op](int(x), int(y)) == int(z), line
      assert int(equations[-1][3]) == answer == _solve_word_problem(problem), line
      assert answer >= 0


@pytest.mark.parametrize("split", corpus.SPLITS)
def test_copies_are_exact(split):
  lengths = set()
  for text in _of_kind(split, "copy"):
    for line in text.split("\n"):
      sequence, rest = line.split(" | ")
      instruction, copy = rest.split(": ")
      assert copy == sequence and " " not in sequence and instruction
      lengths.add(len(sequence))
  assert min(lengths) <= 5 and max(lengths) >= 15


def test_stories_are_stories():
  stories = _of_kind("train", "story")
  assert len(set(stories)) == len(stories)
  for text in stories[:500]:
    assert text.count(". ") >= 5 and text.endswith((".", '!"'))
  # Varied: many distinct opening-plus-second sentences.
  assert len({re.split(r"(?<=\.) ", t)[1] for t in stories}) > 100


def test_write_text_files_round_trip(tmp_path):
  paths = corpus.write_text_files(str(tmp_path / "corpus"))
  assert set(paths) == set(corpus.SPLITS)
  for split, path in paths.items():
    with open(path, encoding="utf-8") as f:
      assert f.read().rstrip("\n").split("\n\n") == [d.text for d in documents(split)]
