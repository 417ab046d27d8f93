"""Stage schedules (Prop-alpha), depth over time, speedups and the stacking config checks."""

import dataclasses
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from midas_jax import configs, flops
from midas_jax.errors import ConfigError
from midas_jax.stacking import checks
from midas_jax.stacking import schedule as sched

# 24 layers in 6 blocks of 4: the block layout of the MIDAS paper's similarity figure.
MODEL = configs.ModelConfig(family="llama", vocab_size=32000, d_model=1024, num_layers=24, num_heads=16,
                            d_ff=4096, max_seq_len=2048)


def test_layer_only_speedups_match_the_paper_arithmetic():
  assert round(sched.layer_only_speedup(4, 1.0), 3) == 1.333
  assert round(sched.layer_only_speedup(6, 1.0), 3) == 1.385
  assert round(sched.layer_only_speedup(6, 2.0), 3) == 1.238
  assert round(sched.layer_only_speedup(4, 2.0), 3) == 1.2
  assert sched.layer_only_speedup(6, 0.0) == pytest.approx(6 * 6 / 21)  # Equal
  assert sched.layer_only_speedup(1, 1.0) == 1.0


def test_prop_alpha_steps_exact_cases():
  assert sched.prop_alpha_steps(1000, 4, 1.0) == (100, 200, 300, 400)
  assert sched.prop_alpha_steps(1000, 4, 0.0) == (250, 250, 250, 250)
  assert sched.prop_alpha_steps(10, 3, 0.0) == (3, 3, 4)  # the leftover step goes to the later stage
  assert sched.prop_alpha_steps(5, 5, 3.0) == (1, 1, 1, 1, 1)  # every stage keeps a step
  assert sched.prop_alpha_steps(5, 3, 2.0) == (1, 1, 3)  # the lifted step comes from stage 2, not 3
  assert sched.prop_alpha_steps(7, 1, 2.0) == (7,)
  # Integer schedule's layer-only speedup is the real-valued one when the division is exact.
  s = sched.StageSchedule(sched.prop_alpha_steps(2100, 6, 1.0), 4)
  assert sched.layer_only_speedup_of(s) == pytest.approx(sched.layer_only_speedup(6, 1.0))


@settings(max_examples=300, deadline=None)
@given(num_stages=st.integers(1, 12), extra=st.integers(0, 5000),
       alpha=st.floats(0.0, 4.0, allow_nan=False))
def test_prop_alpha_steps_properties(num_stages, extra, alpha):
  num_steps = num_stages + extra
  steps = sched.prop_alpha_steps(num_steps, num_stages, alpha)
  assert len(steps) == num_stages and sum(steps) == num_steps
  assert all(isinstance(t, int) and t >= 1 for t in steps)
  assert all(a <= b for a, b in zip(steps, steps[1:]))
  # Largest remainder keeps every stage within one step of its ideal share, unless some ideal share
  # is under one step and the ">= 1 step each" rule has to take steps from elsewhere.
  total = sum(i ** alpha for i in range(1, num_stages + 1))
  ideal = [num_steps * i ** alpha / total for i in range(1, num_stages + 1)]
  if min(ideal) >= 1:
    assert all(abs(t - x) < 1 + 1e-9 for t, x in zip(steps, ideal))


@settings(max_examples=100, deadline=None)
@given(num_stages=st.integers(1, 8), extra=st.integers(0, 300), alpha=st.floats(-2.0, 0.0))
def test_prop_alpha_negative_alpha_still_sums(num_stages, extra, alpha):
  steps = sched.prop_alpha_steps(num_stages + extra, num_stages, alpha)
  assert sum(steps) == num_stages + extra and min(steps) >= 1


def test_starts_stage_at_and_depth_at_agree():
  s = sched.StageSchedule((3, 5, 2), block_size=4)
  assert s.starts == (0, 3, 8) and s.boundaries == (3, 8) and s.num_stages == 3 and s.num_steps == 10
  assert s.depths == (4, 8, 12)
  stages = [s.stage_at(t) for t in range(12)]
  assert stages == [1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3]  # past the end stays in the last stage
  assert [s.depth_at(t) for t in range(10)] == [4] * 3 + [8] * 5 + [12] * 2
  for t in range(10):
    i = sched.stage_at(t, s.starts)
    assert s.starts[i - 1] <= t < s.starts[i - 1] + s.stage_steps[i - 1]
  # Growth happens exactly at the boundaries.
  assert [t for t in range(1, 10) if s.depth_at(t) != s.depth_at(t - 1)] == list(s.boundaries)
  assert sched.stage_starts([]) == ()
  with pytest.raises(ConfigError):
    s.stage_at(-1)


def test_schedule_json_round_trip():
  s = sched.StageSchedule((1, 2, 3), block_size=2)
  assert sched.StageSchedule.from_dict(s.to_dict()) == s
  assert '"starts": [0, 1, 3]' in s.to_json()


def test_schedule_from_config():
  stacking = configs.StackingConfig(num_stages=6, alpha=2.0)
  s = sched.schedule_from_config(stacking, 9100, 24)
  assert s.block_size == 4 and s.depths == (4, 8, 12, 16, 20, 24)
  assert s.stage_steps == tuple(100 * i * i for i in range(1, 7))
  explicit = configs.StackingConfig(num_stages=2, stage_steps=[3, 7])
  assert explicit.stage_steps == (3, 7)
  assert sched.schedule_from_config(explicit, 10, 8).stage_steps == (3, 7)
  base = sched.schedule_from_config(configs.StackingConfig(), 10, 8)
  assert base.stage_steps == (10,) and base.depths == (8,) and base.boundaries == ()
  doubling = sched.schedule_from_config(configs.StackingConfig(num_stages=3, block_size=2, operator="gstack"),
                                        70, 8)
  assert doubling.depths == (2, 4, 8)
  with pytest.raises(ConfigError, match="StackingConfig.stage_steps"):
    sched.schedule_from_config(explicit, 11, 8)


def test_a_schedule_can_start_from_a_deeper_model():
  """A pretrained 4-layer model as 2 blocks of 2, grown by MIDAS to 8 layers in 3 stages."""
  stacking = configs.StackingConfig(num_stages=3, start_blocks=2, alpha=1.0)
  s = sched.schedule_from_config(stacking, 900, 8)
  assert s.block_size == 2 and s.depths == (4, 6, 8)  # block_size None: 8 // (3 + 2 - 1)
  assert s.stage_steps == (200, 300, 400)  # proportional to the blocks of each stage: 2, 3, 4
  run = configs.RunConfig(model=dataclasses.replace(MODEL, num_layers=8),
                          trainer=configs.TrainerConfig(num_steps=900), stacking=stacking)
  assert checks.schedule_for(run) == s
  with pytest.raises(ConfigError, match="start_blocks") as e:
    checks.schedule_for(dataclasses.replace(run, stacking=dataclasses.replace(stacking, block_size=2, start_blocks=3)))
  assert e.value.setting == "StackingConfig.num_stages" and "num_stages=2" in e.value.fix
  with pytest.raises(ConfigError, match="StackingConfig.start_blocks"):
    configs.StackingConfig(start_blocks=0)


def test_flop_speedup_is_below_the_layer_only_figure():
  s = sched.schedule_from_config(configs.StackingConfig(num_stages=6, alpha=1.0), 2100, MODEL.num_layers)
  layer_only = sched.layer_only_speedup_of(s)
  real = sched.flop_speedup(MODEL, 2048, s)
  assert 1.0 < real < layer_only
  assert real > 1.3  # the head is a small share of a 24-layer model's FLOPs
  # By hand: baseline T * f(24) over sum T_i * f(4 i).
  f = [flops.train_flops_per_token(MODEL, 2048, 4 * i) for i in range(1, 7)]
  assert real == pytest.approx(2100 * f[-1] / sum(100 * i * fi for i, fi in enumerate(f, 1)))


def test_flop_speedup_meets_layer_only_when_layers_dominate():
  # A wide model with a tiny vocabulary and short sequences: the head is negligible.
  wide = configs.ModelConfig(family="llama", vocab_size=128, d_model=4096, num_layers=24, num_heads=32,
                             d_ff=16384, max_seq_len=64)
  s = sched.schedule_from_config(configs.StackingConfig(num_stages=6, alpha=2.0), 9100, 24)
  assert sched.flop_speedup(wide, 8, s) == pytest.approx(sched.layer_only_speedup(6, 2.0), rel=2e-3)
  assert sched.flop_speedup(wide, 8, s) < sched.layer_only_speedup(6, 2.0)


def test_cumulative_flops():
  s = sched.schedule_from_config(configs.StackingConfig(num_stages=6, alpha=1.0), 2100, 24)
  tokens = 4096
  per = [tokens * flops.train_flops_per_token(MODEL, 2048, d) for d in s.depths]
  total = sum(t * p for t, p in zip(s.stage_steps, per))
  assert sched.cumulative_flops(MODEL, 2048, tokens, s, 0) == 0.0
  assert sched.cumulative_flops(MODEL, 2048, tokens, s, s.num_steps) == pytest.approx(total)
  assert sched.cumulative_flops(MODEL, 2048, tokens, s, 1) == pytest.approx(per[0])
  assert sched.cumulative_flops(MODEL, 2048, tokens, s, s.boundaries[0] + 1) == pytest.approx(
      100 * per[0] + per[1])
  # Past the end, steps count at full depth; the running total never decreases.
  assert sched.cumulative_flops(MODEL, 2048, tokens, s, s.num_steps + 3) == pytest.approx(total + 3 * per[-1])
  values = [sched.cumulative_flops(MODEL, 2048, tokens, s, t) for t in range(0, 2101, 50)]
  assert values == sorted(values)
  baseline = s.num_steps * per[-1]
  assert baseline / total == pytest.approx(sched.flop_speedup(MODEL, 2048, s))


def test_speedups_refuse_a_schedule_for_another_depth():
  s = sched.StageSchedule((1, 1), block_size=4)
  with pytest.raises(ConfigError, match="ModelConfig.num_layers"):
    sched.flop_speedup(MODEL, 128, s)


def run(layers=8, steps=100, warmup=10, **stacking):
  """A run config with these stacking settings, after its schedule was checked (schedule_for)."""
  config = configs.RunConfig(model=configs.ModelConfig(num_layers=layers),
                             optimizer=configs.OptimizerConfig(warmup_steps=warmup),
                             trainer=configs.TrainerConfig(num_steps=steps),
                             stacking=configs.StackingConfig(**stacking))
  checks.schedule_for(config)
  return config


def test_run_config_accepts_good_stacking():
  assert run().stacking.num_stages == 1
  assert run(num_stages=4).stacking.resolved_block_size(8) == 2
  assert run(num_stages=2, block_size=4, operator="gradstack").stacking.operator == "gradstack"
  assert run(num_stages=3, block_size=2, operator="gstack").stacking.num_stages == 3
  assert run(num_stages=4, stage_steps=(10, 20, 30, 40)).stacking.stage_steps == (10, 20, 30, 40)
  assert run(num_stages=4, lr_schedule="rewarm").stacking.resolved_rewarm_steps(10) == 10
  assert configs.StackingConfig in configs.CONFIG_CLASSES


@pytest.mark.parametrize("kwargs, setting", [
    (dict(num_stages=3), "StackingConfig.num_stages"),  # 8 layers not divisible by 3 stages
    (dict(num_stages=2, block_size=3), "StackingConfig.block_size"),  # 3 does not divide 8
    (dict(num_stages=2, block_size=2), "StackingConfig.num_stages"),  # 2 blocks of 2 is not 8
    (dict(num_stages=4, block_size=2, operator="gstack"), "StackingConfig.num_stages"),  # 2,4,8,16
    (dict(num_stages=4, steps=3), "StackingConfig.num_stages"),  # more stages than steps
    (dict(num_stages=4, stage_steps=(10, 20, 30, 39)), "StackingConfig.stage_steps"),
    (dict(stage_steps=(99,)), "StackingConfig.stage_steps"),
    (dict(num_stages=4, lr_schedule="rewarm", rewarm_steps=25), "StackingConfig.rewarm_steps"),
])
def test_run_config_errors_name_the_setting(kwargs, setting):
  kwargs = dict(kwargs)
  steps = kwargs.pop("steps", 100)
  with pytest.raises(ConfigError) as e:
    run(steps=steps, **kwargs)
  assert e.value.setting == setting
  assert "fix:" in str(e.value)


@pytest.mark.parametrize("kwargs, setting", [
    (dict(num_stages=0), "StackingConfig.num_stages"),
    (dict(block_size=0), "StackingConfig.block_size"),
    (dict(operator=""), "StackingConfig.operator"),
    (dict(alpha=float("nan")), "StackingConfig.alpha"),
    (dict(alpha=float("inf")), "StackingConfig.alpha"),
    (dict(num_stages=2, stage_steps=(5, 0)), "StackingConfig.stage_steps"),  # a stage of 0 steps
    (dict(num_stages=2, stage_steps=(5,)), "StackingConfig.stage_steps"),
    (dict(new_moments="random"), "StackingConfig.new_moments"),
    (dict(lr_schedule="restart"), "StackingConfig.lr_schedule"),
    (dict(rewarm_steps=-1), "StackingConfig.rewarm_steps"),
])
def test_stacking_config_errors(kwargs, setting):
  with pytest.raises(ConfigError) as e:
    configs.StackingConfig(**kwargs)
  assert e.value.setting == setting


def test_unknown_operator_lists_the_known_ones():
  with pytest.raises(ConfigError, match="gradstack") as e:
    run(operator="middle")
  assert "midas" in e.value.fix


def test_prop_alpha_refuses_more_stages_than_steps():
  with pytest.raises(ConfigError, match="StackingConfig.num_stages"):
    sched.prop_alpha_steps(3, 4, 1.0)


def test_stacking_config_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    configs.StackingConfig().num_stages = 2


def test_a_warmup_longer_than_the_first_stage_is_warned_about_naming_the_settings():
  # Prop-1 over 120 steps and 4 stages: 12, 24, 36, 48; a warmup of 20 never reaches the peak in stage 1.
  with pytest.warns(checks.ScheduleWarning) as caught:
    run(steps=120, warmup=20, num_stages=4)
  message = str(caught[0].message)
  assert "OptimizerConfig.warmup_steps=20" in message and "first stage (12" in message and "at most 12" in message
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # none of these warns
    run(steps=120, warmup=12, num_stages=4)
    run(steps=120, warmup=20, num_stages=4, stage_steps=(30, 30, 30, 30))
    run(steps=120, warmup=500)  # no stages, nothing to clash with


@pytest.mark.parametrize("gin_file", ["midas_cpu.gin", "gradstack_cpu.gin", "bench_stacking_cpu.gin",
                                      "study_stacking_cpu.gin"])
def test_the_shipped_cpu_stacking_jobs_warm_up_within_their_first_stage(gin_file):
  from midas_jax import gin_config  # pylint: disable=import-outside-toplevel
  from midas_jax.commands import study_commands  # pylint: disable=import-outside-toplevel
  path = f"experiments/{gin_file}"
  with warnings.catch_warnings():
    warnings.simplefilter("error", checks.ScheduleWarning)
    if gin_file.startswith("study_"):  # as `midas study stacking` reads it, with its own configurable
      config, _, _ = study_commands.stacking_study_from_gin([path], [])
    else:
      gin_config.parse([path], [])
      config = gin_config.run_config_from_gin()
      checks.schedule_for(config)  # where `midas train` checks it
  assert config.stacking.num_stages > 1


def test_the_paper_configs_warn_only_where_their_comment_says_why_and_names_the_fix():
  # prop2/prop3 keep the baseline's 2,000-step warmup on purpose (one schedule for every arm); the
  # others must start quietly, and a warning's file must explain it and give the first stage's length.
  import glob  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  from midas_jax import gin_config  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gin", "experiments")
  warned = {}
  for path in sorted(glob.glob(os.path.join(root, "paper_*.gin"))):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always", checks.ScheduleWarning)
      gin_config.parse([path], [])
      config = gin_config.run_config_from_gin()
      checks.schedule_for(config)  # where `midas train` checks it
    if any(issubclass(w.category, checks.ScheduleWarning) for w in caught):
      st_ = config.stacking
      first = sched.prop_alpha_steps(config.trainer.num_steps, st_.num_stages, st_.alpha, st_.start_blocks)[0]
      warned[os.path.basename(path)] = first
      with open(path) as f:
        comment = f.read()
      assert "ScheduleWarning, on purpose" in comment, path
      assert f"--gin.OptimizerConfig.warmup_steps={first} " in comment, path
  assert sorted(warned) == sorted(f"paper_{s}_midas_prop{a}.gin" for s in ("1b", "2b", "8b") for a in (2, 3))
