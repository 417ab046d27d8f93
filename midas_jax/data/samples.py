"""What the model trains on, in words: packed batches decoded back into examples.

Sentinels print as <extra_id_k> and mode tokens as [NLU] / [NLG] / [S2S], so a span-corruption
example reads like T5's documentation.
"""

from __future__ import annotations

from typing import Dict, Iterator, List

import numpy as np

from midas_jax.data.objectives import SpecialTokens
from midas_jax.train.step import OBJECTIVES


def render(tokens, vocab, special: SpecialTokens) -> str:
  """Decodes tokens, spelling out sentinels and mode tokens instead of dropping them."""
  names = {sid: f"<extra_id_{k}>" for k, sid in enumerate(special.sentinel_ids)}
  names.update({tid: mode for mode, tid in special.mode_ids.items()})
  names[vocab.eos_id] = "</s>"
  parts: List[str] = []
  run: List[int] = []
  for t in np.asarray(tokens).tolist():
    if t in names:
      parts.append(vocab.decode(run))
      parts.append(names[t])
      run = []
    else:
      run.append(t)
  parts.append(vocab.decode(run))
  return "".join(parts)


def sample_records(pipeline, vocab, steps: int, split: str = "train") -> Iterator[Dict[str, object]]:
  """One record per packed example of the first `steps` global batches."""
  for step in range(steps):
    batch = pipeline.batch(step, split)
    for row in range(batch["segment_ids"].shape[0]):
      seg = batch["segment_ids"][row]
      for s in range(1, int(seg.max()) + 1):
        where = seg == s
        tokens = batch["targets"][row][where]
        prefix_len = int((batch["loss_weights"][row][where] == 0).sum())
        yield {
            "step": step, "row": row, "segment": s,
            "objective": OBJECTIVES[int(batch["objective_ids"][row][where][0])],
            "prefix": render(tokens[:prefix_len], vocab, pipeline.special),
            "target": render(tokens[prefix_len:], vocab, pipeline.special),
            "prefix_tokens": prefix_len, "target_tokens": int(len(tokens) - prefix_len),
        }
