"""What both pipelines build UL2 rows from: the objective mix, per-length example tables, and the
placement of examples' tokens in a row (data/pipeline.py draws the examples in memory,
data/store/pipeline.py from a store's windows; both lay them out with `place_examples`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import numpy as np

from midas_jax.configs import ObjectivesConfig
from midas_jax.data.ul2 import objectives

CAUSAL = objectives.Denoiser("causal", "causal")


@dataclasses.dataclass(frozen=True)
class ObjectiveEntry:
  denoiser: objectives.Denoiser
  probability: float


def span_mode(mean_span: float, density: float) -> str:
  """UL2's rule: extreme (X, [NLG]) when spans are long (>= 12) or dense (>= 30%), else R ([NLU])."""
  return "[NLG]" if mean_span >= 12 or density >= 0.3 else "[NLU]"


def objective_mix(config: ObjectivesConfig) -> List[ObjectiveEntry]:
  """The UL2 objectives an example may train, with their per-example probabilities."""
  entries = []
  if config.causal_rate > 0:
    entries.append(ObjectiveEntry(CAUSAL, config.causal_rate))
  if config.prefix_rate > 0:
    entries.append(ObjectiveEntry(objectives.Denoiser("prefix", "prefix", mode="[S2S]"), config.prefix_rate))
  for mean, density in config.span_denoisers if config.span_rate > 0 else ():
    d = objectives.Denoiser(f"span_mu{mean:g}_r{density:g}", "span", float(mean), float(density),
                            span_mode(mean, density))
    entries.append(ObjectiveEntry(d, config.span_rate / len(config.span_denoisers)))
  return entries


CAUSAL_ID, PREFIX_ID, SPAN_ID = (objectives.OBJECTIVE_IDS[k] for k in ("causal", "prefix", "span"))


def example_tables(seq_len: int, config: ObjectivesConfig, entries: Sequence[ObjectiveEntry],
                   special: objectives.SpecialTokens) -> Dict[str, np.ndarray]:
  """What the fill loop and the layout look up instead of computing per example, for each objective
  entry e and length i in [0, seq_len], each (entries, seq_len + 1):
    budget     the longest raw window whose example fits in i slots (0 when under 2 tokens fit,
               which ends the row)
    for a raw length i (under 2 tokens: causal LM, no mode token):
    kind       the objective id
    mode_id    the mode token leading the example, 0 for none
    length     the example's length: the raw tokens, 2 sentinels per span, the mode token
    prefix     its prefix length when no draw decides it (causal 0, span [mode] + inputs)
    num_noise, num_spans   of span corruption
  """
  s = seq_len
  raw = np.arange(s + 1)
  t = {k: np.zeros((len(entries), s + 1), np.int64)
       for k in ("budget", "kind", "mode_id", "length", "prefix", "num_noise", "num_spans")}
  for i, entry in enumerate(entries):
    d = entry.denoiser
    mode = int(config.mode_tokens and d.kind != "causal" and d.mode is not None)
    t["kind"][i], t["mode_id"][i] = objectives.OBJECTIVE_IDS[d.kind], mode and special.mode_ids[d.mode]
    if d.kind == "span":
      t["num_noise"][i], t["num_spans"][i] = objectives.span_count_table(
          s, d.noise_density, d.mean_noise_span_length)
      t["prefix"][i] = mode + raw - t["num_noise"][i] + t["num_spans"][i]
    t["length"][i] = raw + 2 * t["num_spans"][i] + mode
    fits = span_budget_table(seq_len, config.num_sentinels, d) if d.kind == "span" else raw
    t["budget"][i, mode:] = fits[:s + 1 - mode]
  t["budget"][t["budget"] < 2] = 0
  t["kind"][:, :2] = t["mode_id"][:, :2] = t["prefix"][:, :2] = 0  # under 2 raw tokens: causal LM
  t["length"][:, :2] = raw[:2]
  return t


def span_budget_table(seq_len: int, num_sentinels: int, denoiser: objectives.Denoiser) -> np.ndarray:
  """table[b] = the longest raw length whose corrupted length is <= b, for b in [0, seq_len].

  Span corruption also needs a sentinel per span: windows are capped so that they never need more
  than num_sentinels (long rows with dense noise then hold several shorter examples).
  """
  d, mu = denoiser.noise_density, denoiser.mean_noise_span_length
  raw = np.arange(seq_len + 1)
  spans = objectives.span_count_table(seq_len, d, mu)[1]
  usable = raw[spans <= num_sentinels]  # span counts only grow with length
  corrupted = usable + 2 * spans[usable]
  return usable[np.searchsorted(corrupted, raw, side="right") - 1]


def place_examples(size: int, tokens: np.ndarray, first, body, n, kind, mode_id, num_noise, num_spans,
                   span_keys, sentinel_ids: np.ndarray) -> np.ndarray:
  """A flat targets array of `size` slots holding examples, one entry per example in each of the
  arguments: its raw tokens are tokens[first:first + n]; its body (after the mode token mode_id, if
  any) starts at slot `body`; span examples (kind SPAN_ID) are corrupted with their num_noise /
  num_spans counts and span_keys (one row of uint64 keys per span example, in order). Everything
  moves as blocks: the windows of causal and prefix examples, the spans of span examples."""
  targets = np.zeros(size, np.int32)
  mode = mode_id > 0
  targets[body[mode] - 1] = mode_id[mode]
  span = kind == SPAN_ID
  plain = ~span & (n > 0)
  blocks = [(first[plain], body[plain], n[plain])]
  if span.any():
    *spans, sentinel_dest, rank = objectives.span_layout(
        n[span], num_noise[span], num_spans[span], span_keys, in_offsets=first[span], out_offsets=body[span])
    targets[sentinel_dest] = sentinel_ids[rank]
    blocks.append(spans)
  block_src, block_dest, count = (np.concatenate(b) for b in zip(*blocks))
  src = objectives.ranges(block_src, count)
  targets[src + (block_dest - block_src).repeat(count)] = tokens[src]
  return targets
