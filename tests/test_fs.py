"""The path layer on local paths (tests/test_gcs.py runs the same calls against a GCS server)."""

import os

import pytest

from midas_jax import cli, fs
from midas_jax.errors import ConfigError


def test_local_paths_stay_plain_paths(tmp_path):
  target = fs.join(str(tmp_path), "a", "b.json")
  fs.write_json(target, {"x": 1})
  assert os.path.isfile(target) and fs.read_json(target) == {"x": 1}
  assert fs.listdir(fs.join(str(tmp_path), "a")) == ["b.json"]  # no temporary file left behind
  assert not fs.is_remote(target) and fs.scheme("gs://b/x") == "gs"


def test_unknown_scheme_names_the_setting():
  with pytest.raises(ConfigError, match="--workdir.*ftp://"):
    fs.check("ftp://host/run", "--workdir")


def test_a_placeholder_bucket_is_refused_naming_the_setting_before_any_request():
  with pytest.raises(ConfigError) as e:
    fs.check("gs://YOUR_BUCKET/stores/c4_en", "DataConfig.prepared_dir")
  assert e.value.setting == "DataConfig.prepared_dir" and "'YOUR_BUCKET'" in e.value.problem
  for bad in ("gs://", "gs://ab/x", "gs://-bucket/x", "gs://a b/x"):
    with pytest.raises(ConfigError):
      fs.check(bad, "--workdir")
  assert fs.check("gs://my-bucket_1.example/x", "--workdir") == "gs://my-bucket_1.example/x"


def test_the_paper_configs_stop_at_start_until_given_a_bucket(tmp_path, capsys):
  assert cli.main(["train", "--gin_file=gin/experiments/paper_1b_baseline.gin", f"--workdir={tmp_path / 'run'}"]) == 2
  assert "DataConfig.spm_model: 'gs://YOUR_BUCKET/spm/c4_en.model'" in capsys.readouterr().err


def test_glob_recurses_and_sorts(tmp_path):
  for name in ("b/2.txt", "a/1.txt", "a/deep/3.txt"):
    fs.write_text(fs.join(str(tmp_path), name), name)
  found = fs.glob(fs.join(str(tmp_path), "**", "*.txt"))
  assert [os.path.relpath(p, tmp_path) for p in found] == ["a/1.txt", "a/deep/3.txt", "b/2.txt"]


def test_failed_write_keeps_the_old_file(tmp_path):
  target = str(tmp_path / "keep.txt")
  fs.write_text(target, "old")

  class Boom:
    def encode(self, _):
      raise RuntimeError("boom")

  with pytest.raises(RuntimeError):
    fs.write_text(target, Boom())
  assert fs.read_text(target) == "old" and fs.listdir(str(tmp_path)) == ["keep.txt"]
