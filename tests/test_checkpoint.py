"""Orbax checkpoints in the train loop: exact resume across a stage boundary, bad saves skipped,
configs compared, restores onto other meshes, keep policy, params-only exports."""

import dataclasses
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from conftest import tiny_model
from midas_jax import cli, configs
from midas_jax.checkpoint import (OrbaxCheckpointer, available_steps, export_run_params, load_model,
                                  write_params_export)
from midas_jax.checkpoint import damage
from midas_jax.errors import ConfigError, NonFiniteLossError
from midas_jax.stacking.checks import schedule_for
from midas_jax.train.build import build_stage
from midas_jax.train.run import train
from midas_jax.train.metrics import read_metrics

TRACKED = ("loss", "grad_norm", "learning_rate", "stage", "depth", "cumulative_flops", "loss/causal")


def stacked_run(**overrides):
  """4 layers grown in 2 stages (boundary at step 3), a save every 2 steps, all kept."""
  base = dict(
      model=tiny_model(num_layers=4),
      optimizer=configs.OptimizerConfig(learning_rate=3e-3, warmup_steps=2),
      data=configs.DataConfig(seq_len=32, batch_size=8),
      trainer=configs.TrainerConfig(num_steps=8, log_every=1, eval_every=4, eval_batches=1,
                                    progress_bar=False, peak_flops_per_device=1e11),
      stacking=configs.StackingConfig(num_stages=2, stage_steps=(3, 5)),
      checkpoint=configs.CheckpointConfig(every=2, keep=10))
  base.update(overrides)
  return configs.RunConfig(**base)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One uninterrupted run: (config, workdir). It accumulates gradients over 2 microbatches (16 rows
  on 8 devices: one row per device each) and takes the loss in 2 chunks of 16 positions, so every
  resume below also shows both exact through growth."""
  config = stacked_run(data=configs.DataConfig(seq_len=32, batch_size=16),
                       trainer=configs.TrainerConfig(num_steps=8, log_every=1, eval_every=4, eval_batches=1,
                                                     progress_bar=False, peak_flops_per_device=1e11,
                                                     microbatches=2, loss_chunk=16))
  workdir = str(tmp_path_factory.mktemp("reference"))
  train(config, workdir)
  return config, workdir


def crashed_copy(reference_dir, dest, keep_steps):
  """The reference run as a crash would have left it: only the saves of `keep_steps` committed."""
  shutil.copytree(reference_dir, dest)
  for step in available_steps(str(dest)):
    if step not in keep_steps:
      shutil.rmtree(os.path.join(dest, "checkpoints", str(step)))
  return str(dest)


def assert_same_params(a, b):
  flat_a, flat_b = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
  for (path, x), (_, y) in zip(flat_a, flat_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def tracked(workdir, split="train"):
  return [(r["step"],) + tuple(r.get(k) for k in TRACKED) for r in read_metrics(workdir, split)]


def test_saves_land_at_the_interval_the_boundary_and_the_end_with_metadata(reference):
  config, workdir = reference
  assert available_steps(workdir) == [2, 3, 4, 6, 8]  # 3: the grown state at the stage boundary
  ckpt = OrbaxCheckpointer(workdir, config.checkpoint)
  meta = ckpt.metadata(3)
  ckpt.close()
  assert (meta["step"], meta["stage"], meta["depth"]) == (3, 2, 4)
  assert [layer["origin"] for layer in meta["lineage"]] == [0, 1, 0, 1]
  assert meta["growths"][0]["provenance"] == [0, 1, 0, 1]
  assert meta["config"]["model"]["d_model"] == 32 and meta["data"]["seed"] == 0
  assert meta["data"]["mixture"]["special_tokens"]  # sentinel and mode-token ids, pinned
  assert {"jax", "flax", "orbax-checkpoint", "python"} <= set(meta["versions"])


@pytest.mark.parametrize("survivors", [{2, 3}, {2}], ids=["at-the-boundary", "before-the-boundary"])
def test_resume_after_a_crash_is_bitwise_exact(reference, tmp_path, survivors):
  config, ref_dir = reference
  workdir = crashed_copy(ref_dir, tmp_path / "run", survivors)
  result = train(config, workdir)
  assert result.start_step == max(survivors)
  assert_same_params(load_model(workdir).params, load_model(ref_dir).params)
  assert tracked(workdir) == tracked(ref_dir)  # every step once, the same values
  assert tracked(workdir, "eval") == tracked(ref_dir, "eval")
  assert json.load(open(os.path.join(workdir, "stages.json")))["growths"][0]["step"] == 3


def test_a_corrupt_latest_save_is_reported_and_skipped(reference, tmp_path, capfd):
  config, ref_dir = reference
  workdir = crashed_copy(ref_dir, tmp_path / "run", {4, 6})
  params_dir = os.path.join(workdir, "checkpoints", "6", "params")
  for root, _, files in os.walk(params_dir):
    for name in files:
      if not name.startswith("_"):
        with open(os.path.join(root, name), "r+b") as f:
          f.truncate(max(os.path.getsize(f.name) // 3, 1))
  result = train(config, workdir)
  assert result.start_step == 4
  # evidence of damage: a read past the end of a file, or bytes that do not decode
  assert re.search(r"step 6 is damaged \((OUT_OF_RANGE|DATA_LOSS): ", capfd.readouterr().err)
  moved = [n for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.startswith("corrupt-6-")]
  assert len(moved) == 1  # set aside by a rename, with the marker that says why
  marker = json.load(open(os.path.join(workdir, "checkpoints", moved[0], "midas_damaged.json")))
  assert marker["step"] == 6 and re.match("OUT_OF_RANGE|DATA_LOSS", marker["reason"])
  assert_same_params(load_model(workdir).params, load_model(ref_dir).params)


def test_an_interrupted_set_aside_keeps_the_save_unlisted_and_is_finished_before_its_step_is_saved(
    reference, tmp_path):
  config, ref_dir = reference
  workdir = crashed_copy(ref_dir, tmp_path / "run", {4, 6})
  # A set-aside killed between its marker and its move: the save is still in place, with the marker.
  with open(os.path.join(workdir, "checkpoints", "6", damage.MARKER), "w") as f:
    json.dump({"step": 6, "reason": "DATA_LOSS: test"}, f)
  assert available_steps(workdir) == [4]
  result = train(config, workdir)
  assert result.start_step == 4 and available_steps(workdir) == [4, 6, 8]  # step 6 saved again, whole
  (moved,) = [n for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.startswith("corrupt-6-")]
  assert json.load(open(os.path.join(workdir, "checkpoints", moved, damage.MARKER)))["reason"] == "DATA_LOSS: test"
  assert_same_params(load_model(workdir).params, load_model(ref_dir).params)


def test_a_different_config_is_refused_with_its_differences_unless_allowed(reference, tmp_path, capsys):
  config, ref_dir = reference
  workdir = crashed_copy(ref_dir, tmp_path / "run", {4})
  changed = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, learning_rate=1e-3),
                                model=dataclasses.replace(config.model, d_ff=96))
  with pytest.raises(ConfigError) as err:
    train(changed, workdir)
  message = str(err.value)
  assert "optimizer.learning_rate: 0.003 -> 0.001" in message and "model.d_ff: 64 -> 96" in message
  assert "--allow_config_changes=model.d_ff,optimizer.learning_rate" in message
  # Operational changes are always allowed: the mesh, logging, how a step is computed.
  lr_only = dataclasses.replace(config, optimizer=changed.optimizer, mesh=configs.MeshConfig(data=2, fsdp=4),
                                model=dataclasses.replace(config.model, attention="dot_product"),
                                trainer=dataclasses.replace(config.trainer, log_every=2, microbatches=1, loss_chunk=0))
  result = train(lr_only, workdir, allow_config_changes=["optimizer.learning_rate"])
  assert result.start_step == 4 and result.steps == 8


def test_arrays_of_other_shapes_are_damage_unless_the_model_was_changed_on_purpose(reference, tmp_path):
  config, ref_dir = reference
  wider = dataclasses.replace(config, model=dataclasses.replace(config.model, d_ff=96))
  # Allowed on purpose, the change makes the save's arrays another shape: a config error, the save left alone.
  workdir = crashed_copy(ref_dir, tmp_path / "allowed", {4})
  with pytest.raises(ConfigError, match=r"--allow_config_changes.*model.d_ff.*change the model's arrays"):
    train(wider, workdir, allow_config_changes=["model.d_ff"])
  assert available_steps(workdir) == [4]
  assert not any(name.startswith("corrupt-") for name in os.listdir(os.path.join(workdir, "checkpoints")))
  # A save whose metadata claims the wider model while its arrays are not: damage, set aside, and with no
  # other save the run stops listing it.
  workdir = crashed_copy(ref_dir, tmp_path / "lying", {4})
  meta_file = os.path.join(workdir, "checkpoints", "4", "metadata", "metadata")
  meta = json.load(open(meta_file))
  meta["config"]["model"]["d_ff"] = 96
  json.dump(meta, open(meta_file, "w"))
  with pytest.raises(ConfigError, match=r"(?s)on_no_usable_save.*corrupt-4-\d+: the params item's arrays are not the "
                                        r"layout's: layers/mlp/down: saved \(4, 64, 32\) float32, the layout has "
                                        r"\(4, 96, 32\) float32"):
    train(wider, workdir)
  assert available_steps(workdir) == []


def test_the_cli_refuses_an_incompatible_resume_before_training(reference, tmp_path, capsys):
  _, ref_dir = reference
  workdir = crashed_copy(ref_dir, tmp_path / "run", {4})
  # The saved run has 8 steps; the demo config asks for far more and a different model.
  code = cli.main(["train", "--gin_file=gin/experiments/cpu_demo.gin", f"--workdir={workdir}"])
  assert code == 2
  err = capsys.readouterr().err
  assert "different config" in err and "trainer.num_steps" in err and "--allow_config_changes" in err


@pytest.mark.parametrize("save_devices, restore_devices", [(8, 4), (8, 1), (1, 8)])
def test_restore_onto_a_different_mesh(tmp_path, save_devices, restore_devices):
  fsdp = configs.MeshConfig(data=1, fsdp=-1)  # parameters sharded over every device of the mesh
  config = stacked_run(mesh=fsdp, stacking=configs.StackingConfig(),
                       trainer=configs.TrainerConfig(num_steps=2, log_every=1, eval_every=0,
                                                     progress_bar=False, peak_flops_per_device=1e11))
  train(config, str(tmp_path), devices=jax.devices()[:save_devices])
  build = build_stage(config, jax.devices()[:restore_devices])
  ckpt = OrbaxCheckpointer(str(tmp_path), config.checkpoint)
  state = ckpt.restore(build.layout, 2)
  ckpt.close()
  query = state.params["layers"]["attn"]["query"]
  assert len(query.sharding.device_set) == restore_devices
  shardings = jax.tree.leaves(build.layout.shardings)
  assert all(x.sharding == s for x, s in zip(jax.tree.leaves(state), shardings))
  assert_same_params(jax.device_get(state.params), load_model(str(tmp_path)).params)


def test_keep_policy_keeps_the_newest_and_every_mth(tmp_path):
  config = stacked_run(stacking=configs.StackingConfig(),
                       trainer=configs.TrainerConfig(num_steps=10, log_every=1, eval_every=0,
                                                     progress_bar=False, peak_flops_per_device=1e11),
                       checkpoint=configs.CheckpointConfig(every=1, keep=2, keep_every=4))
  train(config, str(tmp_path))
  assert available_steps(str(tmp_path)) == [4, 8, 9, 10]


def test_non_finite_parameters_are_never_saved(reference, tmp_path):
  config, ref_dir = reference
  build = build_stage(config, num_layers=schedule_for(config).depths[1])  # the depth of step 8's stage
  ckpt = OrbaxCheckpointer(ref_dir, config.checkpoint)
  state = ckpt.restore(build.layout, 8)
  ckpt.close()
  bad = state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
  fresh = OrbaxCheckpointer(str(tmp_path), config.checkpoint)
  with pytest.raises(NonFiniteLossError, match="not finite"):
    fresh.save(bad, 9, force=True)
  fresh.close()
  assert available_steps(str(tmp_path)) == []


def test_params_only_export_loads_without_the_optimizer(reference, tmp_path):
  config, ref_dir = reference
  out = export_run_params(ref_dir, str(tmp_path / "export"), step=6)
  assert sorted(os.listdir(out)) == ["metadata.json", "params"]
  model = load_model(out)
  assert (model.step, model.stage, model.model_config.num_layers) == (6, 2, 4)
  assert_same_params(model.params, load_model(ref_dir, step=6).params)
  assert model.vocab.vocab_size <= model.model_config.vocab_size
  with pytest.raises(ConfigError, match="already holds an export"):
    write_params_export(out, model.params, model.config)
  with pytest.raises(ConfigError, match="no checkpoint of step 5"):
    load_model(ref_dir, step=5)
  with pytest.raises(ConfigError, match="neither a run with checkpoints nor a params-only export"):
    load_model(str(tmp_path / "nothing"))


def test_init_from_an_export_starts_a_new_run_from_its_parameters(reference, tmp_path):
  config, ref_dir = reference
  out = export_run_params(ref_dir, str(tmp_path / "export"))
  flat = stacked_run(stacking=configs.StackingConfig(), data=config.data,
                     trainer=dataclasses.replace(config.trainer, num_steps=2, eval_every=0))
  scratch = train(flat, str(tmp_path / "scratch"))
  warm = train(dataclasses.replace(flat, checkpoint=configs.CheckpointConfig(init_from=out)),
                    str(tmp_path / "warm"))
  assert warm.start_step == 0
  first = read_metrics(str(tmp_path / "warm"), "train")[0]["loss"]
  assert first < read_metrics(str(tmp_path / "scratch"), "train")[0]["loss"] - 0.5
  assert scratch.final_loss > warm.final_loss
  shallow = dataclasses.replace(flat, model=tiny_model(num_layers=2),
                                checkpoint=configs.CheckpointConfig(init_from=out))
  with pytest.raises(ConfigError, match="CheckpointConfig.init_from"):
    train(shallow, str(tmp_path / "bad"))


def _saved_arrays(item_dir):
  """(shape, dtype) of every array of one item of a save, from orbax's own record of what it wrote."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  saved = ocp.StandardCheckpointer().metadata(item_dir).item_metadata
  return [(tuple(a.shape), np.dtype(a.dtype)) for a in jax.tree.leaves(saved)]


def test_bench_checkpoint_measures_size_and_stall(tmp_path, no_compile_cache):
  from midas_jax.bench import checkpoint_bench  # pylint: disable=import-outside-toplevel
  # The stall target (< 1 step) is the benchmark's to report, measured in its own run; here the report's
  # figures must be measured, consistent with each other, and the saved bytes those of the state.
  config = stacked_run(stacking=configs.StackingConfig(), data=configs.DataConfig(seq_len=32, batch_size=8))
  report = checkpoint_bench.run(config, str(tmp_path), window=2, repeats=1)
  timed = tmp_path / "sync" / "checkpoints" / "1"  # the timed save, not the untimed one beside it nor the async ones
  files = {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(timed) for f in names}
  on_disk = sum(files.values())
  assert report["checkpoint_bytes"] == on_disk
  # What it holds, exactly: the f32 params, and in the state Adam's two moments of the params' shapes and
  # int32 counters (the step, the optimizer's counts).
  f32, i32 = np.dtype("float32"), np.dtype("int32")
  params, state = _saved_arrays(str(timed / "params")), _saved_arrays(str(timed / "state"))
  assert {d for _, d in params} == {f32} and sum(int(np.prod(s)) for s, _ in params) == report["params"]
  assert sorted(s for s, d in state if d == f32) == sorted(2 * [s for s, _ in params])
  counters = [s for s, d in state if d != f32]
  assert counters == [()] * len(counters) and 1 <= len(counters) <= 4 and {d for _, d in state} == {f32, i32}
  raw = 3 * 4 * report["params"] + 4 * len(counters)
  # On disk the arrays are zstd chunks in OCDBT files (random f32 compresses to ~0.95, and the b-tree
  # nodes rewritten while a save is written stay in the files: 1.02-1.13 x raw over six saves), so only
  # their size is bounded; the rest is orbax's tree, sharding and commit records and our JSON metadata
  # (about 35 KB here, whatever the state's size).
  data = sum(n for path, n in files.items() if os.path.basename(os.path.dirname(path)) == "d")
  assert 0.9 * raw < data < 1.4 * raw, (data, raw)
  assert 0 < on_disk - data < 64 * 1024
  assert report["async_blocking_seconds"] > 0 and report["sync_save_seconds"] > 0 and report["step_seconds"] > 0
  assert report["async_stall_steps"] == report["async_stall_seconds"] / report["step_seconds"]
  assert "async stall" in checkpoint_bench.format_report(report)


def test_a_setting_added_since_the_save_reads_as_its_default():
  from midas_jax.checkpoint import metadata as metadata_lib  # pylint: disable=import-outside-toplevel
  config = configs.RunConfig(model=tiny_model(vocab_size=512), data=configs.DataConfig(seq_len=32))
  new = metadata_lib.config_to_dict(config)
  saved = json.loads(json.dumps(new))
  del saved["model"]["qkv_bias"], saved["stacking"]["start_blocks"]  # as a save from before they existed
  assert metadata_lib.check_resumable(saved, new) == []
  saved["model"]["d_ff"] = 128
  with pytest.raises(ConfigError, match="model.d_ff"):
    metadata_lib.check_resumable(saved, new)
