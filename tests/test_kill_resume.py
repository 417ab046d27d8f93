"""A run killed with SIGKILL anywhere (mid-step, mid-save, either side of a stage transition) or
stopped by SIGTERM, then restarted with the same command, ends bitwise identical to a run that was
never interrupted, and logs the same metrics for every step.

Each kill is triggered by a line the run prints (a step's log line, a save starting, a growth),
optionally after a random delay, so the kill lands at an arbitrary point of the work that follows.
The random kills draw from a seed that is new every session (conftest.KILL_SEED, printed in the
report header and in every failure; MIDAS_KILL_SEED=<seed> replays it).
"""

import os
import random
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import KILL_SEED, REPO_ROOT, tiny_gin
from midas_jax.checkpoint import available_steps, load_model
from midas_jax.train.metrics import read_metrics

# 24 steps, 4 layers grown in 2 stages (Prop-1: the boundary is step 8), a save every 3 steps.
GIN = tiny_gin("""
OptimizerConfig.learning_rate = 3e-3
OptimizerConfig.warmup_steps = 2
TrainerConfig.num_steps = 24
TrainerConfig.log_every = 1
TrainerConfig.eval_every = 12
TrainerConfig.eval_batches = 1
StackingConfig.num_stages = 2
StackingConfig.alpha = 1.0
CheckpointConfig.every = 3
CheckpointConfig.keep = 3
""", num_layers=4)
BOUNDARY = 8
STEP_LINE = r"step \d+ (train|stage)"  # a step's log line, or the growth's
TRACKED = ("loss", "grad_norm", "learning_rate", "stage", "depth", "cumulative_flops")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
  root = tmp_path_factory.mktemp("kill")
  gin_file = root / "run.gin"
  gin_file.write_text(GIN)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             MIDAS_JAX_CACHE_DIR=str(root / "xla_cache"))

  def run(workdir, trigger=None, delay=0.0, sig=signal.SIGKILL, nth=1):
    """Runs `midas train` until `trigger` (a regex) shows in its output for the `nth` time, then
    signals it after `delay` seconds. Returns (signalled, output)."""
    cmd = [sys.executable, "-u", "-m", "midas_jax", "train", f"--gin_file={gin_file}", f"--workdir={workdir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=REPO_ROOT)
    lines, seen = [], 0
    for line in proc.stdout:
      lines.append(line)
      seen += bool(trigger and re.search(trigger, line))
      if trigger and seen == nth:
        time.sleep(delay)
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
        output = "".join(lines) + rest
        assert sig != signal.SIGKILL or proc.returncode == -signal.SIGKILL, (
            f"the run ended (rc {proc.returncode}) before the kill {delay:.2f} s after {trigger!r} landed:\n"
            + output[-2000:])
        return True, output
    proc.wait(timeout=120)
    output = "".join(lines)
    assert proc.returncode == 0, output[-3000:]
    return False, output

  reference = str(root / "reference")
  signalled, _ = run(reference)
  assert not signalled
  return run, reference


def tracked(workdir, split="train"):
  return [(r["step"],) + tuple(r.get(k) for k in TRACKED) for r in read_metrics(workdir, split)]


def assert_identical_runs(workdir, reference):
  ours, theirs = load_model(workdir), load_model(reference)
  assert ours.step == theirs.step == 24
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(ours.params),
                               jax.tree_util.tree_leaves_with_path(theirs.params)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  assert tracked(workdir) == tracked(reference)
  assert tracked(workdir, "eval") == tracked(reference, "eval")
  assert [r["step"] for r in read_metrics(workdir, "stage")] == [BOUNDARY]


def kill_and_finish(run, workdir, kills, note=""):
  """Applies each kill (trigger, delay[, nth]) in turn, restarting after each, then runs to the end."""
  for kill in kills:
    signalled, output = run(workdir, *kill[:2], nth=kill[2] if len(kill) > 2 else 1)
    assert signalled, f"the run ended before {kill[0]!r} showed{note}:\n{output[-2000:]}"
  signalled, output = run(workdir)
  assert not signalled
  return output


def random_kill(rng, step_seconds, max_lines=4):
  """A kill at a random time: a random delay of up to two steps (as the reference run timed them)
  after the 1st to max_lines-th step the restarted run logs, so it lands at any point of a step, a
  save or a growth. Counted from the restart, the trigger shows wherever the last kill landed."""
  return STEP_LINE, rng.uniform(0.0, 2 * step_seconds), rng.randint(1, max_lines)


def reference_step_seconds(reference) -> float:
  return float(np.median([r["step_seconds"] for r in read_metrics(reference, "train") if "step_seconds" in r]))


def replay_note(seed) -> str:
  return f" (random kills of seed {seed}: replay with MIDAS_KILL_SEED={seed})"


def test_sigkill_at_five_points_then_resume_is_bitwise_exact(harness, tmp_path):
  """Three fixed kill points, then two at random times drawn from the session's seed (conftest.py): a fresh
  seed every session, so every CI run kills at two new points (mid-step, mid-save or mid-growth) and the
  runs together soak the random kills; a failure prints the seed that replays it."""
  run, reference = harness
  rng = random.Random(KILL_SEED)
  step_seconds = reference_step_seconds(reference)
  kills = [
      (r"checkpoint: saving step 3\b", 0.0),  # mid-save: the async write of step 3 in flight
      (rf"step {BOUNDARY - 1} train", 0.0),  # just before the stage transition
      (rf"step {BOUNDARY} stage", 0.0),  # just after it: the grown state's save in flight
      random_kill(rng, step_seconds),  # resumed from step 6 or 8: early in stage 2
      random_kill(rng, step_seconds),
  ]
  note = replay_note(KILL_SEED)
  print(f"kills {kills}{note}")
  output = kill_and_finish(run, str(tmp_path / "run"), kills, note)
  assert "resuming from the checkpoint of step" in output, note
  try:
    assert_identical_runs(str(tmp_path / "run"), reference)
  except AssertionError as e:
    raise AssertionError(f"{e}\n{note}") from e


def test_sigterm_saves_and_stops_cleanly_and_the_same_command_resumes(harness, tmp_path):
  run, reference = harness
  workdir = str(tmp_path / "run")
  signalled, output = run(workdir, r"step 13 train", 0.0, sig=signal.SIGTERM)
  assert signalled and "received SIGTERM" in output
  stopped = int(re.search(r"stopped at step (\d+) after saving", output).group(1))
  assert stopped >= 13 and stopped in available_steps(workdir)  # the preemption save, committed
  signalled, output = run(workdir)
  assert f"resuming from the checkpoint of step {stopped}" in output
  assert_identical_runs(workdir, reference)
