"""gin at the edges: parsed bindings configure what gin builds, and nothing else."""

import dataclasses
import subprocess
import sys

import pytest

from conftest import tiny_run
from midas_jax import compare, configs, gin_config
from midas_jax.checkpoint import metadata
from midas_jax.errors import ConfigError


def defaults(cls):
  return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
          for f in dataclasses.fields(cls)}


def test_a_parse_leaves_the_config_classes_alone():
  gin_config.parse(["experiments/midas_cpu.gin"], ["ModelConfig.d_model=96"])
  run = gin_config.run_config_from_gin()
  assert run.stacking.num_stages == 4 and run.model.d_model == 96  # what gin builds takes the bindings
  for cls in configs.CONFIG_CLASSES:  # a plain construction anywhere else does not
    assert dataclasses.asdict(cls()) == dataclasses.asdict(cls(**defaults(cls))), cls.__name__
    assert not hasattr(cls.__init__, "__wrapped__"), f"{cls.__name__}.__init__ was rewritten"
  assert configs.StackingConfig().num_stages == 1 and configs.ModelConfig().d_model == 256


def test_the_baseline_of_a_stacked_config_is_the_plain_full_depth_config():
  gin_config.parse(["experiments/midas_cpu.gin"], ["StackingConfig.stage_steps=(12, 24, 36, 48)"])
  pair = compare.run_pair(gin_config.run_config_from_gin())
  assert pair["baseline"].stacking == configs.StackingConfig()  # no bound stage_steps leak into it
  assert pair["midas"].stacking.stage_steps == (12, 24, 36, 48)


def test_a_moved_setting_is_refused_naming_where_it_went():
  with pytest.raises(ConfigError) as e:
    gin_config.parse(["experiments/cpu_demo.gin"], ["DataConfig.causal_rate=1.0"])
  assert e.value.setting == "DataConfig.causal_rate" and "ObjectivesConfig.causal_rate" in str(e.value)
  gin_config.parse(["experiments/cpu_demo.gin"], ["ObjectivesConfig.causal_rate=1.0",
                                                  "ObjectivesConfig.prefix_rate=0.0", "ObjectivesConfig.span_rate=0.0"])
  assert gin_config.run_config_from_gin().objectives.causal_rate == 1.0


def test_a_config_saved_before_the_move_reads_its_mixture_where_it_is_now():
  saved = metadata.config_to_dict(tiny_run())
  mix = saved.pop("objectives")
  saved["data"].update(mix, causal_rate=1.0, prefix_rate=0.0, span_rate=0.0, mode_tokens=True)  # the old layout
  config = metadata.config_from_dict(saved)
  assert (config.objectives.causal_rate, config.objectives.mode_tokens) == (1.0, True)
  assert config.data == tiny_run().data
  # and resuming from it under the same settings accepts it as the same run
  new = metadata.config_to_dict(dataclasses.replace(tiny_run(), objectives=config.objectives))
  assert metadata.check_resumable(saved, new) == []


def test_an_unknown_setting_names_the_valid_ones():
  with pytest.raises(ConfigError) as e:
    gin_config.parse(["experiments/cpu_demo.gin"], ["ObjectivesConfig.span_rates=0.5"])
  assert e.value.setting == "ObjectivesConfig.span_rates" and "span_rate" in e.value.fix


def test_the_study_configs_bind_by_name_without_the_commands_and_stay_untouched():
  # they register themselves where they are defined (gin_config sits below studies), so a study
  # config binds in a process that never imports the commands
  script = """
import sys
from midas_jax import gin_config
from midas_jax.studies.anchor_config import AnchorStudyConfig
from midas_jax.studies.stacking_config import StackingStudyConfig
gin_config.parse(["experiments/study_stacking_cpu.gin"], ["AnchorStudyConfig.depths = [4]"])
assert gin_config.build(AnchorStudyConfig).depths == (4,), "AnchorStudyConfig"
assert gin_config.build(StackingStudyConfig).k_shot == 3, "StackingStudyConfig"  # the file binds it
assert AnchorStudyConfig().depths == (2, 3) and StackingStudyConfig().k_shot == 5
assert not any(m.startswith("midas_jax.commands") for m in sys.modules), "the commands were imported"
"""
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
