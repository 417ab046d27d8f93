"""UL2 objectives in decoder-only form (DESIGN.md, decision 4): every example is `inputs + targets`.

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
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from midas_jax.data.packing import Example
from midas_jax.errors import ConfigError

KINDS = ("causal", "prefix", "span")
OBJECTIVE_IDS = {"causal": 0, "prefix": 1, "span": 2}  # packing.py's objective_ids
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


# ----------------------------------------------------------------------------- random parts

def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
  """Uniformly random composition of num_items into num_segments positive parts.

  All C(num_items-1, num_segments-1) sets of cut points are equally likely (t5 shuffles a 0/1
  vector with num_segments-1 ones; choosing the cuts directly is the same law).
  """
  cuts = np.sort(rng.choice(num_items - 1, size=num_segments - 1, replace=False) + 1)
  return np.diff(np.concatenate([[0], cuts, [num_items]]))


def random_spans_noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
  """Boolean mask of `length` tokens: alternating non-noise/noise spans, non-noise first.

  Noise and non-noise span lengths are independent uniform segmentations, so the last token is
  always noise (t5's random_roll=False).
  """
  num_noise, spans = _noise_counts(length, noise_density, mean_noise_span_length)
  if spans == 0:
    return np.zeros(length, bool)
  noise = _random_segmentation(num_noise, spans, rng)
  nonnoise = _random_segmentation(length - num_noise, spans, rng)
  lengths = np.stack([nonnoise, noise], axis=1).reshape(-1)
  is_noise = np.tile([False, True], spans)
  return np.repeat(is_noise, lengths)


def span_corruption(tokens, rng: np.random.Generator, noise_density: float = 0.15,
                    mean_noise_span_length: float = 3.0,
                    sentinel_ids: Sequence[int] = ()) -> Tuple[np.ndarray, np.ndarray]:
  """(inputs, targets), T5 layout: noise span k becomes sentinel_ids[k] in the inputs and
  `sentinel_ids[k] span_k` in the targets. sentinel_ids (SpecialTokens.sentinel_ids) must hold at
  least num_spans(len(tokens), ...) ids."""
  tokens = np.asarray(tokens, np.int32)
  mask = random_spans_noise_mask(len(tokens), noise_density, mean_noise_span_length, rng)
  prev = np.concatenate([[False], mask[:-1]])
  first = mask & ~prev  # first token of each noise span
  n = int(first.sum())
  if n > len(sentinel_ids):
    raise ValueError(f"{n} noise spans but only {len(sentinel_ids)} sentinel ids: use a shorter "
                     "sequence (max_raw_length(..., max_spans=...)) or more sentinels")
  sentinels = np.asarray(sentinel_ids[:n], np.int32)
  span = np.cumsum(first) - 1  # span index of each noise token
  inputs = np.where(first, sentinels[np.maximum(span, 0)] if n else 0, tokens)[~(mask & prev)]
  # Targets: noise token with rank r (among noise tokens) in span k sits at r + k + 1, after the
  # k + 1 sentinels so far; sentinel k sits just before its span's first token.
  noise_at = np.flatnonzero(mask)
  targets = np.empty(len(noise_at) + n, np.int32)
  targets[np.arange(len(noise_at)) + span[noise_at] + 1] = tokens[noise_at]
  targets[np.flatnonzero(first[noise_at]) + np.arange(n)] = sentinels
  return inputs.astype(np.int32), targets


def prefix_lm_split(length: int, rng: np.random.Generator) -> int:
  """Prefix length, uniform over [1, length-1]; 0 when length < 2 (nothing to split).

  t5's prefix_lm draws the same law: random_prefix_noise_mask with its default noise_density=0.5
  draws the number of input tokens uniformly from [max(1, round((1-2*density)(L-1))), L-1] =
  [1, L-1]. Lower densities (a narrower range) are not offered here. For L = 1 t5 also gives an
  empty prefix. Unlike Levanter's UL2R, no sentinel is inserted at the split (as in seqio).
  """
  if length < 2:
    return 0
  return int(rng.integers(1, length))


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
    if self.kind not in KINDS:
      raise ValueError(f"Denoiser {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
    d, mu = self.noise_density, self.mean_noise_span_length
    if self.kind == "span" and not (0.0 < d < 1.0 and mu >= 1.0):
      raise ValueError(f"Denoiser {self.name!r}: span corruption needs 0 < noise_density < 1 and "
                       f"mean_noise_span_length >= 1, got {d}, {mu}")

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def default_ul2_denoisers() -> Tuple[Denoiser, ...]:
  """The UL2 paper's mixture (Tay et al. 2022, section 3.1.2): R, X and S denoisers."""
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


def special_tokens(vocab_size: int, extra_ids: int, num_sentinels: int = 100,
                   modes: Sequence[str] = MODES) -> SpecialTokens:
  """Sentinel k = vocab_size-1-k (T5's <extra_id_k>); modes take the next extra ids down.

  vocab_size is the vocabulary's (base + extra_ids), not the model's padded embedding size.
  """
  need = num_sentinels + len(modes)
  if extra_ids < need:
    raise ConfigError("DataConfig.extra_ids",
                      f"{extra_ids} extra ids, but {num_sentinels} sentinels + {len(modes)} mode "
                      f"tokens need {need}", f"set DataConfig.extra_ids >= {need} (128 is the default)")
  top = vocab_size - 1
  return SpecialTokens(tuple(top - k for k in range(num_sentinels)),
                       {m: top - num_sentinels - j for j, m in enumerate(modes)})


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
