"""libtpu flags per TPU generation (midas_jax/tpu_flags.py): which apply, that the user's win, that they are
set before jax starts, and that libtpu itself accepts them (an AOT compile for a v5p slice with them set)."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from midas_jax import configs, tpu_flags
from midas_jax.commands import common
from midas_jax.errors import ConfigError


@pytest.mark.parametrize("accelerator,generation", [
    ("v5p-128", "v5p"), ("V5P-8", "v5p"), ("v5litepod-64", "v5e"), ("v5e-256", "v5e"), ("v4-64", "v4"),
    ("v6e-256", "v6e"), ("v3-8", None), ("gpu-8", None), ("v5", None), ("", None)])
def test_accelerator_types_name_their_generation(accelerator, generation):
  assert tpu_flags.apply("none", accelerator=accelerator, environ={})["generation"] == generation


def test_the_groups_that_apply_follow_the_generation_the_slices_and_the_remat_policy():
  overlap = "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
  vmem = "--xla_tpu_scoped_vmem_limit_kib=98304"
  dcn = "--xla_tpu_enable_data_parallel_all_reduce_opt=true"
  host = "--xla_tpu_host_transfer_overlap_limit=24"
  one = tpu_flags.recommended("v5p")
  assert overlap in one and vmem not in one and dcn not in one and host not in one
  assert vmem in tpu_flags.recommended("v6e") and overlap in tpu_flags.recommended("v4")
  assert dcn in tpu_flags.recommended("v5p", num_slices=2)
  assert host in tpu_flags.recommended("v5e", remat_policy="offload")
  assert len(one) == len(set(one)) and all(f.startswith("--") and "=" in f for f in one)


@pytest.mark.parametrize("generation,kib,recipes", [
    ("v4", None, ["configs/tpu/v4/22b.sh"]),
    ("v5e", None, ["maxtext_v5e_model_configs.py", "llama2-7b-v5e-256", "gpt-3-175b-v5e-256"]),
    ("v5p", None, ["maxtext_v5p_model_configs.py", "llama2_7b_v5p_128", "llama2_70b_v5p_128"]),
    ("v6e", 98304, ["maxtext_trillium_model_configs.py", "llama2-7b-4096", "llama3-8b-8192"])])
def test_the_scoped_vmem_limit_per_generation_is_the_cited_recipes(generation, kib, recipes):
  """MaxText's dense recipes set 96 MiB on v6e and leave libtpu's default on v4, v5e and v5p (issue 39:
  v5p had v6e's value); the value set is the one the table cites, with the recipes it comes from."""
  assert tpu_flags.VMEM_LIMIT_KIB[generation] == kib
  limits = [f for f in tpu_flags.recommended(generation) if f.startswith("--xla_tpu_scoped_vmem_limit_kib=")]
  assert limits == ([] if kib is None else [f"--xla_tpu_scoped_vmem_limit_kib={kib}"])
  assert all(r in tpu_flags.VMEM_SOURCES[generation] for r in recipes)
  group = next(g for g in tpu_flags.GROUPS if g.name.startswith("scoped VMEM"))
  assert (generation in group.generations) == (kib is not None) and tpu_flags.MAXTEXT in group.why
  with open(os.path.join(REPO_ROOT, "docs/pods.md"), encoding="utf-8") as f:
    docs = f.read()
  row = next(line for line in docs.splitlines() if line.startswith("| `--xla_tpu_scoped_vmem_limit_kib="))
  assert row.startswith(f"| `--xla_tpu_scoped_vmem_limit_kib={tpu_flags.VMEM_LIMIT_KIB['v6e']}` | v6e |")
  assert all(r in row for r in recipes if not r.endswith(".sh"))


def test_the_users_flags_keep_their_values_and_none_or_no_tpu_sets_nothing():
  env = {"MIDAS_TPU_ACCELERATOR": "v5p-128", tpu_flags.ENV: "--xla_tpu_scoped_vmem_limit_kib=65536 --foo=1"}
  applied = tpu_flags.apply("auto", environ=env)
  flags = env[tpu_flags.ENV].split()
  assert flags[:2] == ["--xla_tpu_scoped_vmem_limit_kib=65536", "--foo=1"]  # theirs first, as given
  assert not any(f == "--xla_tpu_scoped_vmem_limit_kib=98304" for f in flags)
  assert applied["generation"] == "v5p" and set(applied["added"]) == set(flags[2:]) and applied["added"]
  untouched = {"MIDAS_TPU_ACCELERATOR": "v5p-128"}
  assert tpu_flags.apply("none", environ=untouched)["added"] == [] and tpu_flags.ENV not in untouched
  for env in ({}, {"TPU_ACCELERATOR_TYPE": "gpu-8"}):  # no TPU named: nothing set
    assert tpu_flags.apply("auto", environ=env)["added"] == [] and tpu_flags.ENV not in env
  env = {"TPU_ACCELERATOR_TYPE": "v4-64"}  # the TPU VM's own variable serves too
  assert tpu_flags.apply("auto", environ=env)["generation"] == "v4" and env[tpu_flags.ENV]
  with pytest.raises(ConfigError) as e:
    configs.MeshConfig(tpu_flags="fast")
  assert e.value.setting == "MeshConfig.tpu_flags"


def test_a_run_sets_them_before_jax_distributed_starts(monkeypatch, capsys):
  monkeypatch.setenv("MIDAS_TPU_ACCELERATOR", "v5p-128")
  monkeypatch.delenv(tpu_flags.ENV, raising=False)
  seen = []
  monkeypatch.setattr(common.distributed, "initialize", lambda args: seen.append(os.environ.get(tpu_flags.ENV)))
  config = configs.RunConfig(mesh=configs.MeshConfig(dcn_data=2))
  common.start_backend(config, argparse.Namespace())
  assert seen == [os.environ[tpu_flags.ENV]] and "--xla_tpu_enable_data_parallel_all_reduce_opt=true" in seen[0]
  assert "libtpu flags for v5p-128: " in capsys.readouterr().out


GIN = """
include 'models/llama_tiny.gin'
include 'meshes/single.gin'
include 'data/builtin.gin'
include 'objectives/ul2_midas.gin'
MeshConfig.data = 1
MeshConfig.fsdp = -1
DataConfig.seq_len = 256
DataConfig.batch_size = 16
"""


def _compile_for_v5p(tmp_path, user_flags=""):
  pytest.importorskip("libtpu", reason="the TPU compiler comes with the test extra: pip install -e .[test]")
  gin_file = tmp_path / "tiny.gin"
  gin_file.write_text(GIN)
  out = tmp_path / "report.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", **{tpu_flags.ENV: user_flags})
  env.pop("MIDAS_TPU_ACCELERATOR", None)
  proc = subprocess.run([sys.executable, "-m", "midas_jax", "bench", "compile", f"--gin_file={gin_file}",
                         "--topology=v5p-16", "--method=compile", "--no-estimate", f"--json={out}"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
  return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_libtpu_compiles_a_v5p_program_with_every_flag_and_refuses_an_unknown_one(tmp_path):
  """libtpu stops at a flag it does not know ("Unknown command line flag"), so a compile that runs with the
  table's flags set shows that this libtpu takes every one of them."""
  every = sorted({f for g in tpu_flags.GROUPS for f in g.flags})
  proc, report = _compile_for_v5p(tmp_path, user_flags="")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert report["method"] == "compiled" and report["tpu_flags"] == tpu_flags.recommended("v5p")
  assert "estimated" not in report  # --no-estimate: one compile, not three
  assert "libtpu flags    " in proc.stdout
  proc, report = _compile_for_v5p(tmp_path, user_flags=" ".join(every))  # the groups for other runs too
  assert proc.returncode == 0 and report["method"] == "compiled", proc.stderr[-3000:]
  proc, _ = _compile_for_v5p(tmp_path, user_flags="--xla_midas_no_such_flag=true")
  assert proc.returncode != 0 and "Unknown command line flag 'xla_midas_no_such_flag'" in proc.stdout + proc.stderr
