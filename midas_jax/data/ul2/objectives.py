"""UL2 objectives in decoder-only form (docs/architecture.md#one-example-format): every example is `inputs + targets`.

The inputs are the bidirectional prefix (no loss), the targets are predicted causally.

  causal   inputs = []                      targets = tokens
  prefix   inputs = tokens[:k]              targets = tokens[k:]          k uniform in [1, L-1]
  span     inputs = text, each noise span   targets = s_0 span_0 s_1 span_1 ...
                    replaced by sentinel s_k

Span corruption follows T5's law (t5.data.preprocessors.random_spans_noise_mask with
random_roll=False, noise_span_to_unique_sentinel, nonnoise_span_to_unique_sentinel); the counts
are computed in float32 and rounded half to even exactly as TF does, so for every length L the
number of noise tokens and of spans equals t5's (tests/test_t5_reference.py checks this). Those
counts depend on L only, so the corrupted length is known before any randomness is drawn
(`corrupted_length`, `max_raw_length`): the packer can fill a row exactly.

Differences from t5, all at the edges:
  - no EOS is appended to inputs or targets (t5's Task adds one to each); a document's own EOS, if
    the source appended one, is ordinary text here;
  - L < 2 gives no noise and empty targets (t5 emits the targets [s_0]);
  - more spans than sentinels raises ValueError (t5 silently runs its sentinels down into ordinary
    vocabulary ids);
  - where t5 would fail (more spans than non-noise tokens: density > 0.5 or mean span < 1) we use
    as many spans as fit.

Mode tokens (UL2's [NLU]/[NLG]/[S2S]) are prepended to the inputs, as in the UL2 paper; a causal
example has no inputs and gets none. Sentinels and mode tokens are the vocabulary's top extra ids
(`special_tokens`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from midas_jax.data.ul2 import streams
from midas_jax.data.ul2.packing import Example
from midas_jax.errors import ConfigError

# An example's objective (its denoiser's kind). OBJECTIVES[i] is objective id i in every row
# (packing.py's objective_ids), and the metrics report the loss of each beside the total.
OBJECTIVES = ("causal", "prefix", "span")
OBJECTIVE_IDS = {name: i for i, name in enumerate(OBJECTIVES)}
MODES = ("[NLU]", "[NLG]", "[S2S]")


# ----------------------------------------------------------------------------- span counts

def _noise_counts(length: int, noise_density: float, mean_noise_span_length: float) -> Tuple[int, int]:
  """(noise tokens, noise spans) of a length-`length` sequence; (0, 0) when there is no noise."""
  if not 0.0 <= noise_density <= 1.0 or mean_noise_span_length <= 0:
    raise ValueError(f"need 0 <= noise_density <= 1 and mean_noise_span_length > 0, got "
                     f"{noise_density}, {mean_noise_span_length}")
  if length < 2 or noise_density == 0.0:
    return 0, 0
  # float32 products and np.rint (half to even) reproduce tf.round(tf.cast(x, float32) * density):
  # in float64, 190 * 0.15 rounds to 28 where TF gets 29.
  f32 = np.float32
  num_noise = int(np.rint(f32(length) * f32(noise_density)))
  num_noise = min(max(num_noise, 1), length - 1)
  spans = max(int(np.rint(f32(num_noise) / f32(mean_noise_span_length))), 1)
  # Each span needs a noise token and a non-noise token before it (t5 would fail here).
  return num_noise, min(spans, num_noise, length - num_noise)


def num_spans(raw_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0) -> int:
  """Number of noise spans (= sentinels used) when corrupting `raw_length` tokens."""
  return _noise_counts(raw_length, noise_density, mean_noise_span_length)[1]


def corrupted_length(raw_length: int, noise_density: float = 0.15,
                     mean_noise_span_length: float = 3.0) -> int:
  """len(inputs) + len(targets) after span corruption: every span adds one sentinel to each side."""
  return raw_length + 2 * num_spans(raw_length, noise_density, mean_noise_span_length)


def max_raw_length(budget: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
                   max_spans: Optional[int] = None) -> int:
  """Largest raw length whose corrupted length fits `budget` (and uses at most `max_spans` spans).

  corrupted_length is strictly increasing in the raw length (the span count never decreases), and
  so is num_spans weakly, so a binary search finds the boundary.
  """
  if budget < 0:
    raise ValueError(f"budget must be >= 0, got {budget}")

  def fits(n):
    return (corrupted_length(n, noise_density, mean_noise_span_length) <= budget and
            (max_spans is None or num_spans(n, noise_density, mean_noise_span_length) <= max_spans))

  lo, hi = 0, budget  # fits(0) holds; the answer is <= budget since corruption never shrinks
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if fits(mid):
      lo = mid
    else:
      hi = mid - 1
  return lo


@functools.lru_cache(maxsize=None)
def span_count_table(max_length: int, noise_density: float,
                     mean_noise_span_length: float) -> Tuple[np.ndarray, np.ndarray]:
  """(noise tokens, spans) for every length 0..max_length, read-only: the counts depend on the
  length alone, so the pipeline looks them up instead of rounding float32 per example."""
  counts = np.array([_noise_counts(n, noise_density, mean_noise_span_length)
                     for n in range(max_length + 1)], np.int64).reshape(-1, 2)
  noise, spans = counts[:, 0].copy(), counts[:, 1].copy()
  noise.flags.writeable = spans.flags.writeable = False
  return noise, spans


# ----------------------------------------------------------------------------- random parts
#
# Everything random here is written for many examples at once (the pipeline corrupts a whole batch
# in one call) and takes its randomness as arrays: uint64 keys, one per token, and uniforms. The
# one-example functions below draw those from a numpy Generator and call the same code, so the
# tests of the law (tests/test_objectives.py, tests/test_t5_reference.py) test what trains.

_INDEX_BITS = 20
MAX_LENGTH = (1 << _INDEX_BITS) - 1  # items per row of _random_runs: a key's low bits hold the index
_INDEX_MASK = np.uint64(MAX_LENGTH)
_NEVER = np.uint64(np.iinfo(np.uint64).max)


def random_keys(rng: np.random.Generator, *shape: int) -> np.ndarray:
  """iid uniform uint64 keys of the given shape."""
  return rng.integers(0, 1 << 64, shape, dtype=np.uint64)


def ranges(starts, sizes) -> np.ndarray:
  """The ranges [starts[i], starts[i] + sizes[i]), one after another."""
  starts, sizes = np.asarray(starts, np.int64), np.asarray(sizes, np.int64)
  return np.arange(int(sizes.sum())) + (starts - (sizes.cumsum() - sizes)).repeat(sizes)


def _random_runs(sizes, runs, keys: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """Uniformly random compositions of groups of items, many at once.

  Row r holds groups g = 0, 1, ... (sizes, runs: (rows, groups)) of sizes[r, g] >= 1 items, one
  after another. Group (r, g) is cut into runs[r, g] in [1, sizes[r, g]] runs of >= 1 item: its
  item 0 starts a run, and runs-1 of its items 1..sizes-1, picked uniformly without replacement,
  start the others, so all C(sizes-1, runs-1) compositions are equally likely (t5 shuffles a 0/1
  vector instead; the same law). The picked items are those with the smallest keys: keys[r, i] is
  an iid uniform uint64 for item i of row r (columns past the row's items are ignored), and one
  sort per row finds them.
  Returns (start, size), each (rows, groups, max(runs)): run j of group (r, g) starts at its item
  start[r, g, j] and has size[r, g, j] items; for j >= runs[r, g], start = sizes[r, g], size = 0.
  """
  sizes, runs = np.asarray(sizes, np.int64), np.asarray(runs, np.int64)
  (rows, groups), width = sizes.shape, keys.shape[1]
  ends = sizes.cumsum(axis=1)
  if width > MAX_LENGTH:
    raise ValueError(f"rows of {width} items are longer than the {MAX_LENGTH} supported")
  # Sort keys: the item's group in the top bits (a row sorts group by group; `groups` marks the
  # columns past the row's items, which sort last), then random bits, then the item's index in the
  # row (so keys are distinct: a tie of the random bits, 2**-42 per pair, goes to the lower index).
  # A group's item 0 gets the group's largest key: never picked.
  top = np.uint64(groups.bit_length())
  group_bit = np.uint64(1) << (np.uint64(64) - top)
  row = np.arange(rows)[:, None]
  group = np.zeros((rows, width + 1), np.uint64)  # + 1 at each group's end, summed along the row
  group[row, ends] = group_bit
  sort_keys = (keys >> top) & ~_INDEX_MASK | np.arange(width, dtype=np.uint64)
  sort_keys += group[:, :width].cumsum(axis=1, dtype=np.uint64)
  sort_keys[row, ends - sizes] = np.arange(groups, dtype=np.uint64) * group_bit | (_NEVER >> top)
  sort_keys.sort(axis=1)
  # Group g's picks lead its block of the sorted row, which starts where its items start.
  cols = int(runs.max())
  at = np.minimum((ends - sizes)[:, :, None] + np.arange(cols - 1), width - 1)
  picked = sort_keys.ravel()[row[:, :, None] * width + at] & _INDEX_MASK
  start = np.zeros((rows, groups, cols), np.int64)
  start[:, :, 1:] = picked.view(np.int64) - (ends - sizes)[:, :, None]
  # Item 0 and the picks, in order: unused cells hold the group's size, past every start.
  start = np.where(np.arange(cols) < runs[:, :, None], start, sizes[:, :, None])
  start.sort(axis=2)
  size = np.empty_like(start)
  size[:, :, :-1] = start[:, :, 1:] - start[:, :, :-1]
  size[:, :, -1] = sizes - start[:, :, -1]
  return start, size


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
  """Uniformly random composition of num_items into num_segments positive parts."""
  return _random_runs([[num_items]], [[num_segments]], random_keys(rng, 1, num_items))[1][0, 0]


def span_layout(lengths, num_noise, num_spans, keys: np.ndarray, in_offsets=None, out_offsets=None):
  """Where the spans and sentinels of many span-corrupted examples go, in T5's layout.

  Example e is the tokens [in_offsets[e], in_offsets[e] + lengths[e]) of some token array; it has
  num_noise[e] noise tokens in num_spans[e] >= 1 spans (_noise_counts). Its output takes positions
  [out_offsets[e], out_offsets[e] + lengths[e] + 2 num_spans[e]) of some output array: the inputs
  (each non-noise span followed by its sentinel), then the targets (each sentinel followed by its
  noise span). Offsets default to the examples one after another. keys: (examples, >= max length)
  iid uniform uint64 (random_keys); keys[e, :num_noise[e]] draw the noise span lengths and the
  next keys the non-noise ones, each a uniform composition (t5's random_spans_noise_mask with
  random_roll=False: spans alternate, non-noise first, so the last token is noise).

  Returns (src, dest, size, sentinel_dest, sentinel_rank): span i moves as a block,
  out[dest[i]:dest[i] + size[i]] = tokens[src[i]:src[i] + size[i]] (the noise spans of all examples
  first, then the non-noise ones; some blocks are empty); out[sentinel_dest] =
  sentinel_ids[sentinel_rank].
  """
  length, noise, spans = (np.asarray(a, np.int64) for a in (lengths, num_noise, num_spans))
  if in_offsets is None:
    in_offsets = length.cumsum() - length
  if out_offsets is None:
    out_offsets = (length + 2 * spans).cumsum() - length - 2 * spans
  in_offsets, out_offsets = np.asarray(in_offsets, np.int64), np.asarray(out_offsets, np.int64)
  start, size = _random_runs(np.stack([noise, length - noise], 1), np.stack([spans, spans], 1), keys)
  a_start, b_start = start[:, 0], start[:, 1]  # A[a], B[a]: where span a starts among the noise /
  a_size, b_size = size[:, 0], size[:, 1]      # non-noise tokens; the spans' sizes
  b_next = b_start + b_size                    # B[a+1]; B[spans] = #non-noise
  a = np.arange(start.shape[2])
  src_at, out_at = in_offsets[:, None], out_offsets[:, None]
  targets_at = out_at + (length - noise + spans)[:, None]  # the inputs come first
  # In the text, noise span a follows non-noise spans 0..a, non-noise span a follows noise spans
  # 0..a-1. In the output, non-noise span a follows a sentinels in the inputs, noise span a follows
  # a + 1 in the targets; sentinel a ends non-noise span a and starts noise span a.
  noise_dest = targets_at + a_start + a + 1
  src = np.concatenate([(src_at + a_start + b_next).ravel(), (src_at + b_start + a_start).ravel()])
  dest = np.concatenate([noise_dest.ravel(), (out_at + b_start + a).ravel()])
  used = a < spans[:, None]
  sentinel_dest = np.concatenate([(out_at + b_next + a)[used], noise_dest[used] - 1])
  rank = used.nonzero()[1]  # = a, span by span
  size = np.concatenate([a_size.ravel(), b_size.ravel()])
  return src, dest, size, sentinel_dest, np.concatenate([rank, rank])


def random_spans_noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
  """Boolean mask of `length` tokens: alternating non-noise/noise spans, non-noise first.

  Noise and non-noise span lengths are independent uniform segmentations, so the last token is
  always noise (t5's random_roll=False). The same draw as span_corruption's from the same rng.
  """
  num_noise, spans = _noise_counts(length, noise_density, mean_noise_span_length)
  mask = np.zeros(length, bool)
  if spans:
    src, _, size, _, _ = span_layout([length], [num_noise], [spans], random_keys(rng, 1, length))
    mask[ranges(src[:spans], size[:spans])] = True  # the noise spans come first
  return mask


def span_corruption(tokens, rng: np.random.Generator, noise_density: float = 0.15,
                    mean_noise_span_length: float = 3.0,
                    sentinel_ids: Sequence[int] = ()) -> Tuple[np.ndarray, np.ndarray]:
  """(inputs, targets), T5 layout: noise span k becomes sentinel_ids[k] in the inputs and
  `sentinel_ids[k] span_k` in the targets. sentinel_ids (SpecialTokens.sentinel_ids) must hold at
  least num_spans(len(tokens), ...) ids."""
  tokens = np.asarray(tokens, np.int32)
  num_noise, n = _noise_counts(len(tokens), noise_density, mean_noise_span_length)
  if n > len(sentinel_ids):
    raise ValueError(f"{n} noise spans but only {len(sentinel_ids)} sentinel ids: use a shorter "
                     "sequence (max_raw_length(..., max_spans=...)) or more sentinels")
  if n == 0:
    return tokens.copy(), np.zeros(0, np.int32)
  src, dest, size, sentinel_dest, rank = span_layout([len(tokens)], [num_noise], [n],
                                                     random_keys(rng, 1, len(tokens)))
  out = np.empty(len(tokens) + 2 * n, np.int32)
  out[ranges(dest, size)] = tokens[ranges(src, size)]
  out[sentinel_dest] = np.asarray(sentinel_ids[:n], np.int32)[rank]
  split = len(tokens) - num_noise + n
  return out[:split], out[split:]


def prefix_lengths(lengths, uniforms) -> np.ndarray:
  """Prefix lengths uniform over [1, L-1] from uniforms in [0, 1); 0 where L < 2."""
  lengths = np.asarray(lengths, np.int64)
  return np.where(lengths >= 2, 1 + streams.below(uniforms, lengths - 1), 0)


def prefix_lm_split(length: int, rng: np.random.Generator) -> int:
  """Prefix length, uniform over [1, length-1]; 0 when length < 2 (nothing to split).

  t5's prefix_lm draws the same law: random_prefix_noise_mask with its default noise_density=0.5
  draws the number of input tokens uniformly from [max(1, round((1-2*density)(L-1))), L-1] =
  [1, L-1]. Lower densities (a narrower range) are not offered here. For L = 1 t5 also gives an
  empty prefix. Unlike Levanter's UL2R, no sentinel is inserted at the split (as in seqio).
  """
  return int(prefix_lengths(length, rng.random()))


# ----------------------------------------------------------------------------- denoisers

@dataclasses.dataclass(frozen=True)
class Denoiser:
  """One UL2 denoiser. For "prefix", noise_density 0.5 names t5's prefix_lm default (a uniform
  split); mean_noise_span_length is used by "span" only. mode: its mode token, None for none."""

  name: str
  kind: str
  mean_noise_span_length: float = 3.0
  noise_density: float = 0.15
  mode: Optional[str] = None

  def __post_init__(self):
    if self.kind not in OBJECTIVES:
      raise ValueError(f"Denoiser {self.name!r}: kind {self.kind!r} is not one of {OBJECTIVES}")
    d, mu = self.noise_density, self.mean_noise_span_length
    if self.kind == "span" and not (0.0 < d < 1.0 and mu >= 1.0):
      raise ValueError(f"Denoiser {self.name!r}: span corruption needs 0 < noise_density < 1 and "
                       f"mean_noise_span_length >= 1, got {d}, {mu}")

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def default_ul2_denoisers() -> Tuple[Denoiser, ...]:
  """The UL2 paper's objective mix (Tay et al. 2022, section 3.1.2): R, X and S denoisers."""
  def span(group, mu, r, mode):
    return Denoiser(f"{group}_mu{mu:g}_r{r:g}", "span", float(mu), r, mode)
  return (span("R", 3, 0.15, "[NLU]"), span("R", 8, 0.15, "[NLU]"),
          span("X", 3, 0.5, "[NLG]"), span("X", 8, 0.5, "[NLG]"),
          span("X", 64, 0.15, "[NLG]"), span("X", 64, 0.5, "[NLG]"),
          Denoiser("S", "prefix", 0.0, 0.5, "[S2S]"))


# ----------------------------------------------------------------------------- special tokens

@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  """Sentinel and mode-token ids, pinned in config and checkpoint metadata via to_json."""

  sentinel_ids: Tuple[int, ...]
  mode_ids: Dict[str, int]

  def __post_init__(self):  # own copies, so the record cannot change under a caller's feet
    object.__setattr__(self, "sentinel_ids", tuple(int(i) for i in self.sentinel_ids))
    object.__setattr__(self, "mode_ids", {str(k): int(v) for k, v in self.mode_ids.items()})

  def to_json(self) -> dict:
    return {"sentinel_ids": list(self.sentinel_ids), "mode_ids": dict(self.mode_ids)}

  @classmethod
  def from_json(cls, d: dict) -> "SpecialTokens":
    return cls(tuple(d["sentinel_ids"]), dict(d["mode_ids"]))


def special_tokens(vocab_size: int, extra_ids: int, num_sentinels: int = 100, modes: Sequence[str] = MODES,
                   own: Optional[Dict[str, int]] = None, reserved: int = 0) -> SpecialTokens:
  """Sentinel k = vocab_size-1-k (T5's <extra_id_k>); modes take the next extra ids down.

  vocab_size is the vocabulary's (base + extra_ids), not the model's padded embedding size.
  own: the tokenizer's own tokens by name ("<extra_id_3>", "[NLU]"), which keep their ids; the
  others take the extra ids counting down from the top, in that order (with no own tokens: the rule
  above). reserved: the extra ids at the bottom that the vocabulary took for a pad or eos it lacked
  (data/vocab/vocabulary.py), which the others must not reach.
  """
  own = own or {}
  names = [f"<extra_id_{k}>" for k in range(num_sentinels)] + list(modes)
  need = reserved + sum(n not in own for n in names)
  if extra_ids < need:
    taken = f" and {reserved} appended pad/eos" if reserved else ""
    raise ConfigError("DataConfig.extra_ids",
                      f"{extra_ids} extra ids, but {num_sentinels} sentinels + {len(modes)} mode "
                      f"tokens{taken} need {need}", f"set DataConfig.extra_ids >= {need} (128 is the default)")
  free = iter(range(vocab_size - 1, -1, -1))
  ids = [own[name] if name in own else next(free) for name in names]
  return SpecialTokens(tuple(ids[:num_sentinels]), dict(zip(modes, ids[num_sentinels:])))


def vocabulary_special_tokens(vocab, num_sentinels: int = 100, modes: Sequence[str] = MODES) -> SpecialTokens:
  """special_tokens for a vocabulary (data/vocab/vocabulary.py): its own sentinel and mode tokens where it has
  them, the top extra ids otherwise."""
  names = [f"<extra_id_{k}>" for k in range(num_sentinels)] + list(modes)
  own = {n: i for n in names if (i := vocab.own_token_id(n)) is not None}
  return special_tokens(vocab.vocab_size, vocab.extra_ids, num_sentinels, modes, own, vocab.reserved_extra_ids)


# ----------------------------------------------------------------------------- examples

def _mode_prefix(denoiser: Denoiser, special: SpecialTokens, use_mode_tokens: bool) -> np.ndarray:
  if not use_mode_tokens or denoiser.kind == "causal" or denoiser.mode is None:
    return np.zeros(0, np.int32)
  if denoiser.mode not in special.mode_ids:
    raise ValueError(f"denoiser {denoiser.name!r} wants mode {denoiser.mode!r}, which is not among "
                     f"the special tokens {sorted(special.mode_ids)}")
  return np.asarray([special.mode_ids[denoiser.mode]], np.int32)


def example_length(raw_length: int, denoiser: Denoiser, use_mode_tokens: bool) -> int:
  """len(make_example(...).tokens) for a raw length: deterministic, for packing."""
  n = raw_length
  if denoiser.kind == "span":
    n = corrupted_length(raw_length, denoiser.noise_density, denoiser.mean_noise_span_length)
  mode = use_mode_tokens and denoiser.kind != "causal" and denoiser.mode is not None
  return n + int(mode)


def make_example(tokens, denoiser: Denoiser, rng: np.random.Generator, special: SpecialTokens,
                 use_mode_tokens: bool = False, objective_id: Optional[int] = None) -> Example:
  """One packing.Example: [mode?] inputs targets, prefix_len = len([mode?] inputs).

  objective_id defaults to the kind's (causal 0, prefix 1, span 2).
  """
  tokens = np.asarray(tokens, np.int32)
  if objective_id is None:
    objective_id = OBJECTIVE_IDS[denoiser.kind]
  mode = _mode_prefix(denoiser, special, use_mode_tokens)
  if denoiser.kind == "causal":
    return Example(tokens, 0, objective_id)
  if denoiser.kind == "prefix":
    inputs, targets = np.split(tokens, [prefix_lm_split(len(tokens), rng)])
  else:
    inputs, targets = span_corruption(tokens, rng, denoiser.noise_density,
                                      denoiser.mean_noise_span_length, special.sentinel_ids)
  return Example(np.concatenate([mode, inputs, targets]), len(mode) + len(inputs), objective_id)
