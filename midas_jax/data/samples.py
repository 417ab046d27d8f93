"""What the model trains on, in words: packed batches decoded back into examples.

Sentinels print as <extra_id_k> and mode tokens as [NLU] / [NLG] / [S2S], so a span-corruption
example reads like T5's documentation. From a prepared store each record also says which document
of the split the example came from and which of its tokens it used ("document", "start",
"length": tokens [start, start + length) of that document, before corruption), so coverage can be
checked from the samples alone. From a mixture (data/mixture.py) each record names its row's source
("source"), and carries the store fields where that source is a prepared store.
"""

from __future__ import annotations

from typing import Dict, Iterator, List

import numpy as np

from midas_jax.data.ul2.objectives import OBJECTIVES, SpecialTokens


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


def sample_records(pipeline, vocab, steps: int, split: str = "train", process_index: int = 0,
                   process_count: int = 1) -> Iterator[Dict[str, object]]:
  """One record per packed example of this process's rows of the first `steps` global batches;
  "row" is the row's index in the global batch."""
  with_sources = hasattr(pipeline, "batch_with_sources")
  for step in range(steps):
    if with_sources:
      batch, sources = pipeline.batch_with_sources(step, split, process_index, process_count)
    else:
      batch, sources = pipeline.batch(step, split, process_index, process_count), None
    first_row = process_index * batch["segment_ids"].shape[0]
    for row in range(batch["segment_ids"].shape[0]):
      seg = batch["segment_ids"][row]
      for s in range(1, int(seg.max()) + 1):
        where = seg == s
        tokens = batch["targets"][row][where]
        prefix_len = int((batch["loss_weights"][row][where] == 0).sum())
        record = {
            "step": step, "row": first_row + row, "segment": s,
            "objective": OBJECTIVES[int(batch["objective_ids"][row][where][0])],
            "prefix": render(tokens[:prefix_len], vocab, pipeline.special),
            "target": render(tokens[prefix_len:], vocab, pipeline.special),
            "prefix_tokens": prefix_len, "target_tokens": int(len(tokens) - prefix_len),
        }
        if sources is not None and "source" in sources:
          record["source"] = str(sources["source"][row])
        if sources is not None and sources["document"][row, s - 1] >= 0:  # < 0: a mixture's in-memory source
          record.update({k: int(sources[k][row, s - 1]) for k in ("document", "start", "length")})
        yield record
