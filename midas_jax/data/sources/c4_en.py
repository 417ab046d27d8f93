"""Importing this module registers the seqio Task "c4_en"; gin/data/c4_seqio.gin imports it.

gin cannot call a function, but it imports the modules that a config file's `import` lines name
while it parses the file, so `import midas_jax.data.sources.c4_en` there is what makes the task exist.
The SentencePiece model is $MIDAS_C4_SPM_MODEL, else DEFAULT_SPM_MODEL (the path c4_seqio.gin
also gives DataConfig.spm_model). It is read when the task is first used, and a missing file fails then with
a ConfigError. TFDS data: $TFDS_DATA_DIR (TFDS's own variable), else ~/tensorflow_datasets.
From Python, call `midas_jax.data.sources.seqio_tasks.register_c4(spm_model=...)` instead of importing this.
"""

import os

from midas_jax.data.sources import seqio_tasks

TASK_NAME = "c4_en"
SPM_MODEL_VARIABLE = "MIDAS_C4_SPM_MODEL"
DEFAULT_SPM_MODEL = "~/.cache/midas_jax/spm/c4_en.model"

task = seqio_tasks.register_c4(TASK_NAME, spm_model=os.environ.get(SPM_MODEL_VARIABLE) or DEFAULT_SPM_MODEL)
