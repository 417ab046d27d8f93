"""The built-in corpus: seeded synthetic documents, made in a third of a second, nothing downloaded.

It is made so that a few-million-parameter byte-level model trained for minutes on a CPU learns
things one can measure separately:

  kind         share  what it trains                          what a later evaluation can ask
  facts        0.30   knowledge of a fixed synthetic world    closed-book / open-book questions
  story        0.25   fluent simple English (TinyStories-like) perplexity
  arithmetic   0.15   small word problems, worked answers     the number after "Answer:"
  assignment   0.15   variable chains of depth 0..2, and      the value after "->"
                      sums/differences of two variables
  copy         0.15   exact copying of a random sequence      the copy after ": "

Shares are of documents (exact counts); train has 20,000 documents (4.6 MB) by default
(DataConfig.corpus_documents sets the number: a third of a second per 20,000) and validation 1,000
(0.24 MB). By bytes the shares are about: story 0.40, facts 0.23, arithmetic 0.15, assignment 0.12,
copy 0.10 (stories are the longest documents).

Facts: `world(seed)` holds a few hundred made-up people, each with six attributes (city, color, job,
pet, age, food). A facts document states several of them about one or two people, in sentence
templates, and may end with questions in the form `question()` writes ("Q: How old is Doru? A: 41.").
The questions ask about any attribute of the document's people, stated in it or not, so the corpus
trains both reading the context (open-book) and recall (closed-book). Validation states the same world
with held-out templates, so its facts loss measures knowledge, not memorized sentences.

Reasoning lines are written in the notation the primitives of evals/primitives.py ask in:
`a=5; k=2; b=a; print b -> 5` (assignment), `x=3; y=4; k=1; c=x+y; print c -> 7` (pre-school
math) and `k3#q8z | copy: k3#q8z` (copying, beside other instructions), so every primitive's prompt
format is one the model has read. Held-out questions: `is_held_out(prompt)` puts a fixed tenth of
all possible prompts (by a hash of the prompt text) out of the training split; a train line whose
prompt falls there is redrawn, and the primitives' evaluation questions are drawn only from there.
So no evaluation question can be a training line, however many are asked.

Holdout "composition" (DataConfig.corpus_holdout) goes further: its assignment documents are chains of
depth 0 and 1 only, with no arithmetic lines, in both splits, so the depth-2 and pre-school-math
primitives ask forms the model never read, made of parts it did (one hop; literals, `print`; sums and
differences only in the arithmetic word problems). "none" (the default) makes the corpus described above.

Disjointness: no text appears twice in a split or in both splits; validation documents that a
train document already has are redrawn. No document contains a blank line (text files separate
documents by blank lines).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import zlib
from typing import Callable, Dict, List, Mapping, NamedTuple, Set, Tuple

from midas_jax import fs
from midas_jax.data.sources.splits import SPLITS

SIZES = {"train": 20_000, "validation": 1_000}
KIND_SHARES = (("facts", 0.30), ("story", 0.25), ("arithmetic", 0.15), ("assignment", 0.15),
           ("copy", 0.15))
NUM_ENTITIES = 300
HOLD_OUT_MODULUS = 10  # one prompt in ten is held out of the training split
HOLDOUTS = ("none", "composition")  # DataConfig.corpus_holdout


@dataclasses.dataclass(frozen=True)
class Document:
  kind: str
  text: str


class Fact(NamedTuple):
  entity: str
  attribute: str
  value: str


@dataclasses.dataclass(frozen=True)
class World:
  """The synthetic world the facts documents state; `choices[attribute]` lists its possible values."""

  entities: Tuple[str, ...]
  facts: Tuple[Fact, ...]
  choices: Mapping[str, Tuple[str, ...]]

  def value(self, entity: str, attribute: str) -> str:
    return self._index[(entity, attribute)]

  @functools.cached_property
  def _index(self) -> Dict[Tuple[str, str], str]:
    return {(f.entity, f.attribute): f.value for f in self.facts}


# ---------------------------------------------------------------------------------------------
# The world

_ONSETS = "b d f g h k l m n p r s t v z br dr gr kr tr st sh th".split()
_VOWELS = "a e i o u ai ei ou".split()
_CODAS = ["", "", "", "n", "r", "l", "s", "k"]
_TOWN_ENDINGS = "ford mora dale vik holm ton wick bury".split()

_VALUES = {
    "color": "red blue green yellow purple orange pink brown black white gray teal".split(),
    "job": ("teacher baker farmer doctor pilot painter sailor miner tailor singer builder nurse "
            "writer judge cook guard").split(),
    "pet": "cat dog rabbit parrot turtle hamster goldfish horse goat pony lizard frog".split(),
    "food": "soup bread rice plums cheese noodles pears beans honey fish carrots pie".split(),
    "age": [str(a) for a in range(18, 90)],
}

# Per attribute: templates for train, then (after the bar) the ones held out for validation.
_TEMPLATES = {
    "city": ("{e} lives in {v}.|{e} has a house in {v}.|The home of {e} is in {v}."
             "|{e} is from the town of {v}.", "{e} resides in {v}.|You can find {e} at home in {v}."),
    "color": ("The favorite color of {e} is {v}.|{e} likes the color {v} best."
              "|{e} loves anything that is {v}.|Of all colors, {e} prefers {v}.",
              "{e} would always pick {v} as a color.|The color {e} likes most is {v}."),
    "job": ("{e} works as a {v}.|{e} is a {v} by trade.|The job of {e} is to be a {v}."
            "|Every day {e} goes to work as a {v}.",
            "{e} earns a living as a {v}.|By profession, {e} is a {v}."),
    "pet": ("{e} has a pet {v}.|The pet of {e} is a {v}.|{e} takes care of a {v} at home."
            "|{e} owns a {v}.", "At home, {e} keeps a {v} as a pet.|A {v} lives with {e} as a pet."),
    "age": ("{e} is {v} years old.|The age of {e} is {v}.|{e} turned {v} this year."
            "|{e} has lived for {v} years.", "{e} is now {v}.|Ask {e} and you will hear: {v} years."),
    "food": ("{e} likes to eat {v}.|The favorite food of {e} is {v}.|{e} eats {v} whenever possible."
             "|For dinner, {e} always wants {v}.",
             "No food makes {e} happier than {v}.|{e} enjoys {v} more than any other food."),
}
_QUESTIONS = {
    "city": "Where does {e} live?", "color": "What is the favorite color of {e}?",
    "job": "What is the job of {e}?", "pet": "What pet does {e} have?",
    "age": "How old is {e}?", "food": "What is the favorite food of {e}?",
}
ATTRIBUTES = tuple(_QUESTIONS)


def question(entity: str, attribute: str) -> str:
  """The prompt of a question as the corpus writes it; the answer follows as f" {value}."."""
  return f"Q: {_QUESTIONS[attribute].format(e=entity)} A:"


def _made_up_word(rng: random.Random, syllables: int) -> str:
  parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)]
  return ("".join(parts) + rng.choice(_CODAS)).capitalize()


@functools.lru_cache(maxsize=8)
def world(seed: int = 0) -> World:
  """The synthetic world of `seed`: NUM_ENTITIES people, each with one value per attribute."""
  rng = random.Random(f"midas-corpus/world/{seed}")
  towns: List[str] = []
  while len(towns) < 24:
    town = _made_up_word(rng, rng.randint(1, 2)) + rng.choice(_TOWN_ENDINGS)
    if town not in towns:
      towns.append(town)
  names: List[str] = []
  taken = set(towns)
  while len(names) < NUM_ENTITIES:
    name = _made_up_word(rng, rng.choice((2, 2, 3)))
    if name not in taken:
      taken.add(name)
      names.append(name)
  choices = {"city": tuple(towns), **{k: tuple(v) for k, v in _VALUES.items()}}
  facts = tuple(Fact(n, a, rng.choice(choices[a])) for n in names for a in ATTRIBUTES)
  return World(entities=tuple(names), facts=facts, choices=choices)


def _facts_doc(rng: random.Random, w: World, split: str) -> str:
  held_out = split != "train"
  people = rng.sample(w.entities, rng.choice((1, 1, 2)))
  lines = []
  for person in people:
    said = []
    for attribute in rng.sample(ATTRIBUTES, rng.randint(2, 4)):
      template = rng.choice(_TEMPLATES[attribute][held_out].split("|"))
      said.append(template.format(e=person, v=w.value(person, attribute)))
    lines.append(" ".join(said))
  asked = [(p, a) for p in people for a in ATTRIBUTES]
  for person, attribute in rng.sample(asked, rng.choice((0, 1, 1, 2))):
    lines.append(f"{question(person, attribute)} {w.value(person, attribute)}.")
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Reasoning: assignment chains, copying, arithmetic

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_SYMBOLS = "abcdefghijklmnopqrstuvwxyz0123456789#@%&*+"
_COPY_INSTRUCTIONS = ("copy", "repeat it", "say it again", "write the same")


def is_held_out(prompt: str) -> bool:
  """Whether a reasoning question (its prompt, ending on its answer marker) is held out of training.

  A pure function of the text (CRC-32, not Python's salted hash), so the corpus and the evaluations
  agree on it in every process. Copy lines are keyed by their canonical prompt `SEQ | copy:`
  whatever instruction they use.
  """
  return zlib.crc32(prompt.encode("utf-8")) % HOLD_OUT_MODULUS == 0


def _trainable(make: Callable[[random.Random], Tuple[str, str]], rng: random.Random, split: str) -> str:
  """A line `prompt + answer` from make(rng) -> (key prompt, line); in train, never a held-out one."""
  while True:
    key, line = make(rng)
    if split != "train" or not is_held_out(key):
      return line


def _chain_line(rng: random.Random, max_depth: int = 2) -> Tuple[str, str]:
  """`a=5; k=2; b=a; print b -> 5`: a chain of `depth` hops from a literal, with literal distractors."""
  depth = rng.randint(0, max_depth)
  names = rng.sample(_LETTERS, depth + 3)
  chain, distractors = names[:depth + 1], names[depth + 1:depth + 1 + rng.randint(1, 2)]
  value = rng.randint(0, 9)
  statements = [f"{chain[0]}={value}"] + [f"{b}={a}" for a, b in zip(chain, chain[1:])]
  for d in distractors:  # anywhere, the chain keeping its order
    statements.insert(rng.randint(0, len(statements)), f"{d}={rng.randint(0, 9)}")
  prompt = "; ".join(statements) + f"; print {chain[-1]} ->"
  return prompt, f"{prompt} {value}"


def math_question(rng: random.Random) -> Tuple[str, int, str]:
  """(prompt, result, op) of `x=3; y=4; k=1; c=x+y; print c ->`: two digit literals and a distractor in
  random order, then their sum or difference (never negative). The pre-school-math primitive
  (evals/primitives.py) asks exactly these."""
  a, b, c, k = rng.sample(_LETTERS, 4)
  op = rng.choice("+-")
  x, y = rng.randint(0, 9), rng.randint(0, 9)
  if op == "-" and x < y:
    x, y = y, x
  literals = [f"{a}={x}", f"{b}={y}", f"{k}={rng.randint(0, 9)}"]
  rng.shuffle(literals)
  prompt = "; ".join(literals + [f"{c}={a}{op}{b}"]) + f"; print {c} ->"
  return prompt, x + y if op == "+" else x - y, op


def _math_line(rng: random.Random) -> Tuple[str, str]:
  prompt, result, _ = math_question(rng)
  return prompt, f"{prompt} {result}"


def _assignment_doc(rng: random.Random, w: World, split: str, holdout: str = "none") -> str:
  """4 to 8 lines; a quarter of them (on average) arithmetic on variables, the rest chains; under holdout
  "composition" every line a chain of depth 0 or 1."""
  if holdout == "composition":
    return "\n".join(_trainable(functools.partial(_chain_line, max_depth=1), rng, split)
                     for _ in range(rng.randint(4, 8)))
  return "\n".join(_trainable(_math_line if rng.random() < 0.25 else _chain_line, rng, split)
                   for _ in range(rng.randint(4, 8)))


def _copy_line(rng: random.Random) -> Tuple[str, str]:
  seq = "".join(rng.choices(_SYMBOLS, k=rng.randint(4, 16)))
  return f"{seq} | copy:", f"{seq} | {rng.choice(_COPY_INSTRUCTIONS)}: {seq}"


def _copy_doc(rng: random.Random, w: World, split: str) -> str:
  return "\n".join(_trainable(_copy_line, rng, split) for _ in range(rng.randint(3, 6)))


_PEOPLE = "Tom Anna Sam Lily Ben Mia Max Lucy Jack Emma Leo Nora Ted Ruth Paul Zoe".split()
_ITEMS = "apples pens stickers marbles cookies books shells stamps coins flowers".split()


def _word_problem(rng: random.Random) -> str:
  n, m = rng.sample(_PEOPLE, 2)
  item = rng.choice(_ITEMS)
  form = rng.randrange(5)
  if form == 0:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"{n} has {a} {item} and buys {b} more. {a} + {b} = {a + b}. Answer: {a + b}"
  if form == 1:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return (f"{n} finds {a} {item} in the morning and {b} {item} in the afternoon. "
            f"{a} + {b} = {a + b}. Answer: {a + b}")
  if form == 2:
    a = rng.randint(2, 20)
    b = rng.randint(1, a)
    return f"{n} has {a} {item} and gives {b} to {m}. {a} - {b} = {a - b}. Answer: {a - b}"
  if form == 3:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (f"{n} has {a} bags with {b} {item} in each bag. {a} * {b} = {a * b}. "
            f"Answer: {a * b}")
  a, b = rng.randint(1, 15), rng.randint(1, 15)
  c = rng.randint(1, a + b)
  return (f"{n} has {a} {item}, gets {b} more from {m} and then loses {c}. "
          f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}. Answer: {a + b - c}")


def _arithmetic_doc(rng: random.Random, w: World, split: str) -> str:
  return "\n".join(_word_problem(rng) for _ in range(rng.randint(2, 4)))


# ---------------------------------------------------------------------------------------------
# Stories

_CHILDREN = [("Lily", "girl", "she"), ("Tom", "boy", "he"), ("Mia", "girl", "she"),
             ("Ben", "boy", "he"), ("Sue", "girl", "she"), ("Max", "boy", "he"),
             ("Anna", "girl", "she"), ("Tim", "boy", "he"), ("Rosa", "girl", "she"),
             ("Sam", "boy", "he")]
_FRIENDS = ["a little dog named Spot", "a kind cat named Milo", "a small bird named Pip",
            "a friend named Jo", "a big brother named Dan", "a little sister named Kim"]
_PLACES = ["park", "forest", "beach", "garden", "farm", "lake", "hill", "school yard"]
_THINGS = ["ball", "kite", "hat", "toy car", "book", "shell", "drum", "boat", "doll", "bike"]
_ADJECTIVES = ["red", "blue", "shiny", "big", "little", "green", "soft", "new", "yellow", "old"]
_WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "cloudy"]
_SPOTS = ["a tree", "a big rock", "the bench", "a bush", "the fence", "a pile of leaves"]
_FEARS = ["the dark", "deep water", "the big slide", "loud thunder", "the tall ladder"]
_TREATS = ["cookies", "grapes", "cake", "candy", "berries", "sandwiches"]


def _story_doc(rng: random.Random, w: World, split: str) -> str:
  name, kind, he = rng.choice(_CHILDREN)
  He = he.capitalize()
  friend = rng.choice(_FRIENDS)
  pal = friend.split()[-1]  # the friend's name
  place, weather = rng.choice(_PLACES), rng.choice(_WEATHER)
  thing = f"{rng.choice(_ADJECTIVES)} {rng.choice(_THINGS)}"
  opening = rng.choice([f"Once upon a time, there was a little {kind} named {name}.",
                        f"{name} was a little {kind} who loved to play.",
                        f"There once was a {kind} called {name}."])
  plot = rng.randrange(4)
  if plot == 0:  # lost and found
    a, b, c = rng.sample(_SPOTS, 3)
    body = [f"{name} had a {thing}.", f"One {weather} day, {name} went to the {place} with {friend}.",
            f"{He} played with the {thing.split()[-1]} all morning.",
            f"Then {name} could not find it. {He} felt {rng.choice(['sad', 'upset', 'worried'])}.",
            f'{pal} said, "Let us look together."', f"They looked under {a} and behind {b}.",
            f"At last, {pal} found the {thing.split()[-1]} near {c}.",
            f'{name} was very happy. {He} said, "Thank you, {pal}!"']
  elif plot == 1:  # a fear overcome
    fear = rng.choice(_FEARS)
    body = [f"{name} was afraid of {fear}.", f"One {weather} day at the {place}, {name} saw {fear}.",
            f"{He} wanted to run home.", f'But {friend} came and said, "Do not be scared. I am here."',
            f"{name} took a deep breath and tried again.",
            rng.choice(["It was not so bad after all.", f"Soon {he} was laughing."]),
            f"{name} felt {rng.choice(['brave', 'proud', 'strong'])}."]
  elif plot == 2:  # sharing
    treat = rng.choice(_TREATS)
    n = rng.randint(2, 9)
    body = [f"{name} went to the {place} with a bag of {treat}.",
            f"There {he} met {friend}, who looked {rng.choice(['hungry', 'sad', 'tired'])}.",
            f"{name} had {n} {treat} and {pal} had none.",
            f'{name} said, "Let us share." {He} gave some {treat} to {pal}.',
            f"They ate the {treat} together under {rng.choice(_SPOTS)}.",
            "Sharing made them both happy."]
  else:  # building something, a setback, trying again
    work = rng.choice(["a sand castle", "a tall tower of blocks", "a little house of sticks",
                       "a snowman", "a paper boat"])
    trouble = rng.choice(["a big wave came", "the wind blew hard", "a dog ran by", "it began to rain"])
    body = [f"One {weather} day, {name} went to the {place}.", f"{He} wanted to make {work}.",
            f"{He} worked and worked, and it looked very good.",
            f"Then {trouble}, and it fell down.", f"{name} was sad, but {friend} came to help.",
            f"Together they made {work} again, even better than before.",
            f"{name} learned that it is good to try again."]
  ending = rng.choice(["The end.", f"{name} went home with a big smile.",
                       f"That night, {name} dreamed about the {place}.", ""])
  return " ".join([opening] + body + ([ending] if ending else []))


_GENERATORS: Dict[str, Callable[[random.Random, World, str], str]] = {
    "facts": _facts_doc, "story": _story_doc, "arithmetic": _arithmetic_doc,
    "assignment": _assignment_doc, "copy": _copy_doc,
}


# ---------------------------------------------------------------------------------------------
# Splits

def split_size(split: str, train_size: int = SIZES["train"]) -> int:
  """The documents of `split` in a corpus of `train_size` training documents (validation: always 1,000)."""
  return train_size if split == "train" else SIZES[split]


def kind_counts(split: str, train_size: int = SIZES["train"]) -> Dict[str, int]:
  """Exact number of documents of each kind in `split` (largest-remainder rounding of KIND_SHARES)."""
  total = split_size(split, train_size)
  counts = {k: int(p * total) for k, p in KIND_SHARES}
  by_remainder = sorted(KIND_SHARES, key=lambda kp: -(kp[1] * total - int(kp[1] * total)))
  for k, _ in by_remainder[:total - sum(counts.values())]:
    counts[k] += 1
  return counts


@functools.lru_cache(maxsize=8)
def _documents(split: str, seed: int, holdout: str = "none", train_size: int = SIZES["train"]) -> Tuple[Document, ...]:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; the built-in corpus has {SPLITS}")
  if holdout not in HOLDOUTS:
    raise ValueError(f"unknown corpus holdout {holdout!r}; use one of {HOLDOUTS} (DataConfig.corpus_holdout)")
  w = world(seed)
  # Validation is drawn after train and skips any text train has; train skips its own repeats.
  seen: Set[str] = set() if split == "train" else {d.text for d in _documents("train", seed, holdout, train_size)}
  docs: List[Document] = []
  for kind, count in kind_counts(split, train_size).items():
    rng = random.Random(f"midas-corpus/{kind}/{split}/{seed}")
    made, attempts = 0, 0
    while made < count:
      attempts += 1
      if attempts > 10 * count + 100:
        raise RuntimeError(f"corpus kind {kind!r} cannot make {count} distinct documents")
      held = (holdout,) if kind == "assignment" and holdout != "none" else ()  # only assignment reads it
      text = _GENERATORS[kind](rng, w, split, *held)
      if text in seen:
        continue
      seen.add(text)
      docs.append(Document(kind, text))
      made += 1
  random.Random(f"midas-corpus/order/{split}/{seed}").shuffle(docs)
  return tuple(docs)


def documents(split: str, seed: int = 0, holdout: str = "none", train_size: int = SIZES["train"]) -> List[Document]:
  """The documents of `split` ("train" or "validation") for `seed`, in a fixed shuffled order.
  train_size: the training documents (DataConfig.corpus_documents); each kind's documents of a larger
  corpus begin with those of a smaller one, but the order differs, and so may the validation documents
  (they skip every training text)."""
  return list(_documents(split, seed, holdout, int(train_size)))


def write_text_files(out_dir: str, seed: int = 0) -> Dict[str, str]:
  """Writes train.txt and validation.txt (documents separated by one blank line); returns the paths."""
  out_dir = fs.check(out_dir, "--out")
  fs.makedirs(out_dir)
  paths = {}
  for split in SPLITS:
    paths[split] = fs.join(out_dir, f"{split}.txt")
    fs.write_text(paths[split], "\n\n".join(d.text for d in _documents(split, seed)) + "\n")
  return paths
