"""A run on several machines takes paths every machine sees as one (train/shared_paths.py)."""

import dataclasses

import pytest

from conftest import tiny_run
from midas_jax import configs, hosts
from midas_jax.errors import ConfigError
from midas_jax.train.shared_paths import check_shared_paths


def _run(prepared_dir=None, shared=False):
  data = (configs.DataConfig(source="prepared", prepared_dir=prepared_dir, seq_len=32, batch_size=8)
          if prepared_dir else configs.DataConfig(seq_len=32, batch_size=8))
  run = tiny_run(data=data)
  return dataclasses.replace(run, trainer=dataclasses.replace(run.trainer, shared_filesystem=shared))


def test_one_machine_takes_any_path():
  check_shared_paths(_run("/data/store"), "/runs/a", machines=1)


@pytest.mark.parametrize("workdir,store,setting", [
    ("/runs/a", None, "--workdir"),
    ("/runs/a", "gs://bucket/store", "--workdir"),
    ("gs://bucket/runs/a", "/data/store", "DataConfig.prepared_dir"),
    ("gs://bucket/runs/a", "~/.cache/midas_jax/stores/c4_en", "DataConfig.prepared_dir"),
])
def test_several_machines_refuse_a_local_workdir_or_store_naming_it(workdir, store, setting):
  with pytest.raises(ConfigError) as e:
    check_shared_paths(_run(store), workdir, machines=2)
  assert e.value.setting == setting and "2 machines" in str(e.value)
  assert "gs://" in e.value.fix and "TrainerConfig.shared_filesystem=True" in e.value.fix


def test_several_machines_take_urls_or_paths_declared_shared():
  check_shared_paths(_run("gs://bucket/store"), "gs://bucket/runs/a", machines=4)
  check_shared_paths(_run("/nfs/store", shared=True), "/nfs/runs/a", machines=4)


def test_one_process_is_one_machine():
  assert hosts.machine_count() == 1  # the two-process runs of test_multihost.py count one machine too
