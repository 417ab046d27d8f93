"""Emergency checkpoints (checkpoint/emergency.py) in a two-process job: one process is killed (SIGKILL) after
a local save and before the next persistent one; resumed, the job continues from the local save where the
killed host's local directory survives, and from the persistent save where it does not, and both resumes
train on exactly as the run they replace.

The pair (jax.distributed on 127.0.0.1, 4 simulated devices each, the state sharded over all 8) trains 8
steps growing from 2 to 4 layers at step 4, saving persistently every 4 steps and locally every 2. Process
1 kills itself when it is handed step 7's state to save (7 steps done, the local save of step 6 committed);
then the test kills process 0, which waits in step 8's collectives, as a slice's supervisor would.
Steps lost: 7 - 6 = 1 from the local save, 7 - 4 = 3 from the persistent one.
"""

import glob
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import REPO_ROOT, tiny_gin
from midas_jax.checkpoint import available_steps
from midas_jax.checkpoint.damage import CorruptCheckpointError, LayoutMismatchError
from midas_jax.checkpoint.emergency import TMP_PREFIX, LocalTier, local_root
from midas_jax.configs import CheckpointConfig
from midas_jax.errors import ConfigError
from midas_jax.train.metrics import read_metrics
from test_peer_failures import BOUND_S, run_pair
from test_pod import _free_port
from midas_jax.train_state import StateLayout, TrainState

KILLED_AT, LOCAL, PERSISTENT = 7, 6, 4  # steps done when process 1 dies; the newest local and persistent saves
GIN = tiny_gin("""
StackingConfig.num_stages = 2
StackingConfig.block_size = 2
StackingConfig.stage_steps = (4, 4)
TrainerConfig.num_steps = 8
TrainerConfig.log_every = 1
TrainerConfig.eval_every = 0
DataConfig.prefetch = 0
MeshConfig.data = 1
MeshConfig.fsdp = -1
CheckpointConfig.every = 4
CheckpointConfig.local_every = 2
CheckpointConfig.local_dir = '{local_dir}'
""", num_layers=4)
RESUMED = {}  # the losses of the resume from the local save
KILL_HOOK = """
# Process 1 dies (SIGKILL) when handed the state of step {killed} to save: after its local save of step {local}.
import os, signal
from midas_jax.checkpoint import emergency
_save = emergency.EmergencyCheckpointer.save
def save(self, state, step, force=False, metadata=None):
  if step == {killed}:
    self.local.wait()
    os.kill(os.getpid(), signal.SIGKILL)
  return _save(self, state, step, force, metadata)
emergency.EmergencyCheckpointer.save = save
"""


def _committed(local_dir, process, step) -> bool:
  return bool(glob.glob(os.path.join(local_dir, "*", f"process_{process}", str(step), "metadata.json")))


def _losses(workdir) -> dict:
  return {r["step"]: r["loss"] for r in read_metrics(workdir, "train")}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
  """A pair killed as above: (gin file, workdir, local_dir, env, root), with a copy of both directories."""
  root = tmp_path_factory.mktemp("emergency")
  workdir, local_dir = str(root / "run"), str(root / "local")
  gin_file = root / "run.gin"
  gin_file.write_text(GIN.format(local_dir=local_dir))
  hook = root / "hook"
  hook.mkdir()
  (hook / "sitecustomize.py").write_text(textwrap.dedent(KILL_HOOK.format(killed=KILLED_AT, local=LOCAL)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT, PYTHONUNBUFFERED="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=4", MIDAS_JAX_CACHE_DIR=str(root / "xla_cache"))
  port, start = _free_port(), time.monotonic()
  procs = [subprocess.Popen([sys.executable, "-u", "-m", "midas_jax", "train", f"--gin_file={gin_file}",
                             f"--workdir={workdir}", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                             f"--process_id={i}", "--peer_timeout_s=60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e, cwd=REPO_ROOT)
           for i, e in enumerate([env, dict(env, PYTHONPATH=f"{hook}:{REPO_ROOT}")])]
  try:
    out1 = procs[1].communicate(timeout=BOUND_S)[0]
    assert procs[1].returncode == -signal.SIGKILL, out1[-3000:]
    while not _committed(local_dir, 0, LOCAL) and time.monotonic() - start < BOUND_S:
      time.sleep(0.1)  # process 0's local save of step 6 lands on its own thread
  finally:
    procs[0].kill()
    out0 = procs[0].communicate(timeout=30)[0]
    procs[1].kill()
  assert _committed(local_dir, 0, LOCAL) and _committed(local_dir, 1, LOCAL), out0[-3000:]
  assert available_steps(workdir) == [PERSISTENT], out0[-3000:]  # killed before the next persistent save
  shutil.copytree(root, root.parent / "emergency_copy", ignore=shutil.ignore_patterns("xla_cache"))
  return gin_file, workdir, local_dir, env, root


def _restore_copy(root):
  for name in ("run", "local"):
    shutil.rmtree(root / name)
    shutil.copytree(root.parent / "emergency_copy" / name, root / name)


def test_a_host_whose_local_copy_survives_resumes_from_the_local_save(killed):
  gin_file, workdir, local_dir, env, root = killed
  before = _losses(workdir)  # the killed run's steps, stored at its saves
  codes, outputs, _ = run_pair(gin_file, workdir, [env, env])
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
  assert f"restored step {LOCAL} from the local copies" in outputs[0], outputs[0][-3000:]
  assert f"resuming from the checkpoint of step {LOCAL}" in outputs[0]
  print(f"steps lost with the local save: {KILLED_AT - LOCAL}")
  after = _losses(workdir)
  assert [s for s in after if s <= LOCAL] == [s for s in before if s <= LOCAL]  # kept, not redone
  RESUMED["local"] = after


def test_a_host_whose_local_copy_is_lost_resumes_from_the_persistent_save(killed):
  gin_file, workdir, local_dir, env, root = killed
  _restore_copy(root)
  before = _losses(workdir)
  shutil.rmtree(local_root(local_dir, workdir, 1))  # process 1's host came back with an empty disk
  codes, outputs, _ = run_pair(gin_file, workdir, [env, env])
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
  assert f"resuming from the checkpoint of step {PERSISTENT}" in outputs[0], outputs[0][-3000:]
  assert "from the local copies" not in outputs[0]
  print(f"steps lost with the persistent save: {KILLED_AT - PERSISTENT}")
  after = _losses(workdir)
  # Exact resume: the steps redone equal the killed run's (an uninterrupted run up to step 7) ...
  redone = [s for s in before if PERSISTENT < s <= LOCAL]
  assert redone and [after[s] for s in redone] == [before[s] for s in redone]
  # ... and the steps after the local save equal those of the resume from it.
  from_local = RESUMED["local"]  # the test before this one
  later = [s for s in from_local if s > LOCAL]
  assert later == [LOCAL + 1, 8] and [after[s] for s in later] == [from_local[s] for s in later]


def _layout(state, shardings=None) -> StateLayout:
  return StateLayout(abstract=jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state), logical=None,
                     shardings=shardings or jax.tree.map(lambda a: a.sharding, state))


def test_the_local_tier_round_trips_its_shards_and_refuses_what_it_cannot_restore(tmp_path):
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  rows, whole = NamedSharding(mesh, P("a", None)), NamedSharding(mesh, P())
  w = jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(8, 4).astype(jnp.bfloat16), rows)
  state = TrainState(step=jax.device_put(jnp.array(5, jnp.int32), whole), params={"w": w},
                     opt_state=(jax.device_put(jnp.ones(3, jnp.float32) / 3, whole),))
  (tmp_path / f"{TMP_PREFIX}4").mkdir()  # a write a kill interrupted: removed, never listed
  tier = LocalTier(str(tmp_path), keep=1)
  assert tier.steps() == [] and not (tmp_path / f"{TMP_PREFIX}4").exists()
  tier.save(state, 5, {"stage": 2})
  tier.wait()
  back = tier.restore(_layout(state), 5)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
    assert a.dtype == b.dtype and a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b))
  assert tier.metadata(5) == {"stage": 2, "step": 5}
  columns = jax.tree.map(lambda _: whole, state)
  columns.params["w"] = NamedSharding(mesh, P(None, "b"))  # saved by rows: this copy lacks the columns
  with pytest.raises(CorruptCheckpointError, match="lacks the part of"):
    tier.restore(_layout(state, columns), 5)
  grown = state.replace(params={"w": jnp.zeros((16, 4), jnp.bfloat16)})  # another stage's shapes
  with pytest.raises(LayoutMismatchError, match="not the layout's"):
    tier.restore(_layout(grown, jax.tree.map(lambda _: whole, grown)), 5)
  tier.save(state, 6, {})
  tier.wait()
  assert tier.steps() == [6]  # keep = 1


def test_local_settings_are_checked():
  for bad in (dict(local_dir="gs://bucket/local"), dict(local_dir=""), dict(local_every=0), dict(local_keep=0)):
    with pytest.raises(ConfigError, match="CheckpointConfig.local_"):
      CheckpointConfig(**bad)
  assert CheckpointConfig().local_dir is None  # off by default
