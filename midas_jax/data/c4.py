"""C4 (TFDS) as a seqio Task tokenized by a SentencePiece model: the data of real pretraining runs.

seqio and TensorFlow are imported inside `register_c4` only. The default TFDS version, c4/en:3.0.1,
is the one T5 trained on; TFDS's current code builds 3.1.0, so 3.0.1 loads only from prepared files
in `data_dir` (None: TFDS's default, $TFDS_DATA_DIR or ~/tensorflow_datasets). Building C4 yourself
(`tfds build c4/en`) needs Apache Beam and a Common Crawl download.
"""

from __future__ import annotations

import functools
from typing import Optional

from midas_jax import fs
from midas_jax.data import seqio_source

C4_TFDS_NAME = "c4/en:3.0.1"


def register_c4(name: str = "c4_en", *, spm_model: str, tfds_name: str = C4_TFDS_NAME,
                data_dir: Optional[str] = None, extra_ids: int = 128):
  """Registers (or re-registers) `name`: C4's "text" as "targets", SentencePiece ids, then EOS.

  The model file is read when the task is first used, not here, so registering never fails on it.
  Its extra_ids must equal DataConfig.extra_ids (the run checks the vocabularies agree).
  """
  seqio = seqio_source.import_seqio()  # lazy: TensorFlow

  vocab = seqio.SentencePieceVocabulary(fs.check(spm_model, "DataConfig.spm_model"), extra_ids=extra_ids)
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.TfdsDataSource(tfds_name=tfds_name, tfds_data_dir=data_dir),
      preprocessors=[
          functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
          functools.partial(seqio.preprocessors.tokenize, copy_pretokenized=False),
          seqio.preprocessors.append_eos,
      ],
      output_features={"targets": seqio.Feature(vocabulary=vocab, add_eos=True)},
      metric_fns=[],
  )
