"""Pods that install and restart by themselves: launch/tpu_pod.py (TPU VMs, queued resources), launch/gke.py
(a JobSet), the worker's start-up script and systemd unit, and what a worker installs.

gcloud, kubectl and systemd are never run: the launchers' dry runs are read, the start-up script runs in
a folder with stand-ins for gcloud, pip, uv and systemctl, and the unit is checked by systemd-analyze.
"""

import ast
import base64
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from conftest import REPO_ROOT
from midas_jax.configs import DataConfig
from midas_jax.data.pipeline import tokenize_documents
from midas_jax.data.sources import text_files
from midas_jax.data.store import format as store_format
from midas_jax.data.store import writer
from midas_jax.data.vocab.vocabulary import ByteVocabulary
from test_launch import dry_run

sys.path.insert(0, os.path.join(REPO_ROOT, "launch"))
import _tpu_worker  # noqa: E402  pylint: disable=wrong-import-position
import gke  # noqa: E402  pylint: disable=wrong-import-position

GS_MIDAS = ["train", "--gin_file=gin/experiments/midas_cpu.gin", "--workdir=gs://bucket/runs/x"]
POD = ["--name=pod", "--zone=us-east5-a", "--project=proj"]
WORKER_FILES = re.compile(r"(>\s*\S|nohup|\.log\b|\.pid\b|tee )")  # a run's output written on a worker's disk
TO_NOWHERE = re.compile(r"\d?>(/dev/null|&\d)")


def written(notes, path_end):
  """The text a dry run would have written to the file whose path ends with `path_end`."""
  lines, inside = [], False
  for note in notes:
    if note.startswith("# would write "):
      inside = note.rstrip(":").endswith(path_end)
    elif inside and note.startswith("#   "):
      lines.append(note[len("#   "):])
    elif inside and note == "#":
      lines.append("")
  return "\n".join(lines) + "\n"


def verbs(cmds):
  return [c[4] if c[:3] == ["gcloud", "compute", "tpus"] else " ".join(c[:2]) for c in cmds]


def test_tpu_pod_up_stages_the_run_and_creates_the_slice_with_a_startup_script():
  notes, cmds = dry_run("tpu_pod.py", "up", "--dry-run", *POD, "--accelerator=v5p-128", "--spot", "--", *GS_MIDAS)
  assert verbs(cmds) == ["tar czf", "gcloud storage", "gcloud storage", f"{sys.executable} -m", "gcloud storage",
                         "gcloud storage", "describe", "create", "ssh"]
  tar, upload, probe, download, sync, marker, _, create, follow = cmds
  # The wheelhouse: staged once for these constraints (the probe), every wheel a worker installs, for its platform
  key = _tpu_worker.wheelhouse_key(REPO_ROOT, "tpu")
  assert probe == ["gcloud", "storage", "ls", f"gs://bucket/runs/x/launch/wheelhouse/staged-{key}"]
  assert download[3] == "download" and "--only-binary=:all:" in download
  assert "--platform=manylinux_2_35_x86_64" in download and "--python-version=3.11" in download
  assert "jax[tpu]>=0.10.0,<0.12" in download and f"uv=={_tpu_worker.UV_VERSION}" in download
  assert download[download.index("-c") + 1] == os.path.join(REPO_ROOT, "requirements", "constraints.txt")
  assert sync[:3] == ["gcloud", "storage", "rsync"] and sync[-2] == download[download.index("--dest") + 1]
  assert sync[-1] == "gs://bucket/runs/x/launch/wheelhouse" and marker[-1] == probe[-1]
  assert tar[-2:] == [REPO_ROOT, "."] and "--exclude=.git" in tar and "--exclude=.venv" in tar
  assert upload[:3] == ["gcloud", "storage", "cp"] and upload[3] == tar[2]
  assert upload[-1] == "gs://bucket/runs/x/launch/"  # the stage: beside the run, where every boot finds it
  assert "--accelerator-type=v5p-128" in create and "--version=v2-alpha-tpuv5" in create and "--spot" in create
  script_path = next(a.split("=", 2)[2] for a in create if a.startswith("--metadata-from-file=startup-script="))
  assert all("--zone=us-east5-a" in c and "--project=proj" in c for c in cmds if c[1] == "compute")
  script = written(notes, script_path)
  assert "STAGE=gs://bucket/runs/x/launch" in script and "UNIT=midas-midas" in script and "EXTRAS=tpu" in script
  assert "@" not in script.split("MIDAS_ROOT=")[0]  # every setting filled in
  unit = written(notes, "midas-midas.service")
  assert "Restart=always" in unit and "RestartPreventExitStatus=0 2 3" in unit and "WantedBy=multi-user.target" in unit
  assert unit.count("ExecStart=") == 1
  exec_start = next(l for l in unit.splitlines() if l.startswith("ExecStart="))
  assert exec_start.endswith(" -m midas_jax " + " ".join(f'"{a}"' for a in GS_MIDAS))
  assert 'Environment="MIDAS_JAX_CACHE_DIR=gs://bucket/xla_cache"' in unit  # the pod's compiles, shared
  assert 'Environment="MIDAS_TPU_ACCELERATOR=v5p-128"' in unit  # the run's libtpu flags are the v5p's
  assert "--worker=0" in follow
  assert any("journalctl --unit=google-startup-scripts.service --unit=midas-midas" in a for a in follow)
  assert any("does not exist yet" in n for n in notes)
  assert not any("--coordinator_address" in " ".join(c) for c in cmds)  # TPU VMs are found from their metadata


def test_tpu_pod_queues_one_slice_or_several_with_spot_or_reserved_capacity():
  _, cmds = dry_run("tpu_pod.py", "queue", "--dry-run", *POD, "--accelerator=v5e-64", "--reserved", "--wheelhouse=off",
                    "--", *GS_MIDAS)
  assert verbs(cmds) == ["tar czf", "gcloud storage", "create"]
  queue = cmds[-1]
  assert queue[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "pod"]
  assert "--node-id=pod" in queue and "--reserved" in queue and "--spot" not in queue
  assert "--accelerator-type=v5e-64" in queue and "--runtime-version=v2-alpha-tpuv5-lite" in queue
  assert any(a.startswith("--metadata-from-file=startup-script=") for a in queue)
  _, cmds = dry_run("tpu_pod.py", "queue", "--dry-run", *POD, "--accelerator=v5p-128", "--slices=2", "--spot",
                    "--", *GS_MIDAS)
  queue = cmds[-1]
  assert "--node-count=2" in queue and "--node-prefix=pod" in queue and "--spot" in queue
  assert not any(a.startswith("--node-id") for a in queue)


def test_tpu_pod_watch_queues_a_suspended_or_failed_resource_again():
  notes, cmds = dry_run("tpu_pod.py", "watch", "--dry-run", *POD, "--accelerator=v5p-128", "--spot", "--poll_s=60",
                        "--wheelhouse=off", "--", *GS_MIDAS)
  assert [c[4] if c[2] == "tpus" else c[1] for c in cmds] == [
      "describe", "czf", "storage", "create", "delete", "create", "storage"]
  assert cmds[-1] == ["gcloud", "storage", "cat", "gs://bucket/runs/x/heartbeat.json"]  # each poll (test_heartbeat.py)
  assert "--format=value(state.state)" in cmds[0]
  assert any("SUSPENDED or FAILED" in n for n in notes)
  delete, requeue = cmds[-3:-1]
  assert delete[:6] == ["gcloud", "compute", "tpus", "queued-resources", "delete", "pod"] and "--force" in delete
  assert requeue == cmds[3]  # the same request as the first one, start-up script and all


def test_tpu_pod_run_restarts_the_run_on_every_worker_of_every_slice():
  notes, cmds = dry_run("tpu_pod.py", "run", "--dry-run", *POD, "--queued", "--slices=2", "--env=FOO=bar baz",
                        "--wheelhouse=off", "--", *GS_MIDAS)
  ssh = [c for c in cmds if c[4] == "ssh"]
  restarts = [c for c in ssh if "--command=sudo google_metadata_script_runner startup" in c]
  assert [c[5] for c in restarts] == ["pod-0", "pod-1"] and all("--worker=all" in c for c in restarts)
  assert not any(c[4] == "update" for c in cmds)  # a queued resource's slices have the script already
  assert 'Environment="FOO=bar baz"' in written(notes, "midas-midas.service")
  for cmd in cmds:  # the run's output goes to the journal and the bucket, never a file on a worker
    assert not any(WORKER_FILES.search(TO_NOWHERE.sub("", a)) for a in cmd if a.startswith("--command=")), cmd
  _, cmds = dry_run("tpu_pod.py", "run", "--dry-run", *POD, "--wheelhouse=off", "--", *GS_MIDAS)
  # a VM made directly gets the script in its metadata first; then the restart, and the log
  assert [c[4] for c in cmds if c[1] == "compute"] == ["update", "ssh", "ssh"]


@pytest.mark.parametrize("action,flags,verb,expected", [
    ("stop", [], "ssh", "sudo systemctl stop midas-midas"),  # not `kill`: a unit told to stop is not restarted
    ("delete", [], "delete", "--quiet"),
    ("delete", ["--queued"], "delete", "--force"),
    ("logs", [], "ssh", "journalctl --unit=google-startup-scripts.service --unit=midas-midas --follow"),
])
def test_tpu_pod_single_actions(action, flags, verb, expected):
  _, cmds = dry_run("tpu_pod.py", action, "--dry-run", "--name=pod", "--zone=z", *flags)
  assert len(cmds) == 1 and cmds[0][4] == verb and any(expected in a for a in cmds[0])
  assert ("queued-resources" in cmds[0]) == ("--queued" in flags)


@pytest.mark.parametrize("args,message", [
    (["create", "--name=p", "--zone=z", "--", *GS_MIDAS], "--accelerator"),
    (["up", "--name=p", "--zone=z", "--accelerator=v5p-8", "--slices=2", "--", *GS_MIDAS], "queue"),
    (["run", "--name=p", "--zone=z", "--", "train", "--workdir=/nfs/x"], "--stage"),
    (["queue", "--name=p", "--zone=z", "--accelerator=v5p-8", "--spot", "--reserved", "--", *GS_MIDAS], "--reserved"),
])
def test_tpu_pod_refuses_what_it_cannot_do(args, message):
  proc = subprocess.run([sys.executable, "launch/tpu_pod.py", "--dry-run", *args], cwd=REPO_ROOT,
                        capture_output=True, text=True)
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_local_workdir_on_shared_storage_needs_a_stage_and_is_pointed_out():
  notes, cmds = dry_run("tpu_pod.py", "run", "--dry-run", *POD, "--stage=gs://b/stage", "--compile_cache=off",
                        "--", "train", "--workdir=/nfs/runs/x")
  assert any("is a path on each worker" in n for n in notes)
  assert cmds[1][-1] == "gs://b/stage/"
  assert 'Environment="MIDAS_JAX_CACHE_DIR=off"' in written(notes, "midas-midas.service")


# --- the worker's side: the unit and the start-up script --------------------------------------------------


def test_the_unit_passes_every_argument_through_systemd_unchanged(tmp_path):
  args = ["train", "--gin.DataConfig.prepared_dir=\"'gs://b/x'\"", "a b", "100%", "$HOME", "back\\slash"]
  text = _tpu_worker.unit_file("x", args, {"FOO": "bar baz", "RATE": "50%$x"})
  exec_start = next(l for l in text.splitlines() if l.startswith("ExecStart="))
  assert exec_start.split(" -m midas_jax ", 1)[1] == (
      '"train" "--gin.DataConfig.prepared_dir=\\"\'gs://b/x\'\\"" "a b" "100%%" "$$HOME" "back\\\\slash"')
  assert 'Environment="RATE=50%%$x"' in text  # Environment= expands % specifiers but not $VARIABLES
  if shutil.which("systemd-analyze") is None:
    pytest.skip("systemd-analyze is not installed")
  root = tmp_path / "root"
  (root / "src").mkdir(parents=True)
  (root / "venv" / "bin").mkdir(parents=True)
  (root / "venv" / "bin" / "python").write_text("#!/bin/sh\n")
  (root / "venv" / "bin" / "python").chmod(0o755)
  path = tmp_path / "midas-x.service"
  path.write_text(text.replace(_tpu_worker.ROOT, str(root)))
  proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
  assert proc.returncode == 0 and str(path) not in proc.stderr, proc.stderr


UV_STUB = """#!/bin/bash
echo "uv $*" >> "$CALLS"
if [ "$1" = venv ]; then mkdir -p "$4/bin" && touch "$4/bin/python" && chmod +x "$4/bin/python"; fi
"""
STUBS = {  # stand-ins that log their arguments: gcloud copies from a folder standing for the bucket
    "gcloud": """
if [ "$1 $2" = "storage rsync" ]; then  # a folder of the bucket into a local one
  src="${@: -2:1}"; dest="${@: -1}"; mkdir -p "$dest"; cp -r "$FAKE_GCS/${src#gs://}/." "$dest/"; exit $?
fi
if [ "$1 $2" != "storage cp" ]; then exit 3; fi
shift 2; dest="${@: -1}"
for src in "${@:1:$#-1}"; do cp "$FAKE_GCS/${src#gs://}" "$dest" || exit 1; done""",
    "python3": """
if [ "$*" = "-m pip --version" ]; then exit 0; fi
mkdir -p "$6/bin"; cp "$UV_STUB" "$6/bin/uv"; chmod +x "$6/bin/uv"  # -m pip install -q --target DIR uv==V
""",
    "systemctl": "",
    "apt-get": "",
}


def boot(script, tmp_path, env):
  proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
  calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
  (tmp_path / "calls").write_text("")
  return proc, calls


def stage_checkout(bucket, tmp_path, marker="# the checkout\n"):
  """A source archive on the stand-in bucket; another marker is another checkout (`tpu_pod.py run`)."""
  checkout = tmp_path / "checkout"
  checkout.mkdir(exist_ok=True)
  (checkout / "setup.py").write_text(marker)
  with tarfile.open(bucket / _tpu_worker.SOURCE_ARCHIVE, "w:gz") as tar:
    tar.add(checkout, arcname=".")


def startup_sandbox(tmp_path, run="r"):
  """A worker in a folder: a stand-in bucket with the stage, stand-ins for gcloud, pip, uv and systemctl,
  and the start-up script; returns (script, env, bucket, root)."""
  bucket, stubs, root = tmp_path / "gcs" / "b" / "stage", tmp_path / "bin", tmp_path / "root"
  bucket.mkdir(parents=True)
  stubs.mkdir()
  for name, body in STUBS.items():
    (stubs / name).write_text(f'#!/bin/bash\necho "{name} $*" >> "$CALLS"\n{body}\n')
    (stubs / name).chmod(0o755)
  stage_checkout(bucket, tmp_path)
  (bucket / _tpu_worker.WHEELHOUSE).mkdir()
  (bucket / f"midas-{run}.service").write_text(_tpu_worker.unit_file(run, GS_MIDAS, {}))
  (tmp_path / "uv_stub").write_text(UV_STUB)
  script = tmp_path / "startup.sh"
  script.write_text(_tpu_worker.startup_script("gs://b/stage", f"midas-{run}", "tpu"))
  for folder in ("units", "run"):
    (tmp_path / folder).mkdir()
  env = dict(PATH=f"{stubs}:/usr/bin:/bin", CALLS=str(tmp_path / "calls"), FAKE_GCS=str(tmp_path / "gcs"),
             MIDAS_ROOT=str(root), UNIT_DIR=str(tmp_path / "units"), RUN_DIR=str(tmp_path / "run"),
             RETRY_DELAY_S="0", UV_STUB=str(tmp_path / "uv_stub"))
  return script, env, bucket, root


def test_the_startup_script_installs_once_and_starts_the_run_at_every_boot(tmp_path):
  script, env, bucket, root = startup_sandbox(tmp_path)
  proc, first = boot(script, tmp_path, env)  # the first boot of a new slice
  assert proc.returncode == 0, proc.stdout + proc.stderr
  uv, wheels = f"{root}/uv/bin/uv", f"--no-index --find-links {root}/wheelhouse"
  assert first == [
      f"gcloud storage cp gs://b/stage/midas_src.tgz gs://b/stage/midas-r.service {root}/stage/",
      "systemctl stop midas-r",
      "gcloud storage rsync --recursive --delete-unmatched-destination-objects gs://b/stage/wheelhouse "
      f"{root}/wheelhouse",
      "python3 -m pip --version",
      f"python3 -m pip install -q --target {root}/uv {wheels} uv=={_tpu_worker.UV_VERSION}",
      "uv python install 3.11",
      f"uv venv --python 3.11 {root}/venv",
      f"uv pip install -q --python {root}/venv/bin/python {wheels} -c {root}/src/requirements/constraints.txt "
      f"-e {root}/src[tpu]",
      "systemctl daemon-reload", "systemctl enable midas-r", "systemctl reset-failed midas-r",
      "systemctl start midas-r"], (first, uv)
  assert (root / "src" / "setup.py").exists()
  unit = (tmp_path / "units" / "midas-r.service").read_text()
  assert f"ExecStart={root}/venv/bin/python -m midas_jax" in unit and "@MIDAS_ROOT@" not in unit

  # A reboot (maintenance): the stage is the one installed, so nothing is installed and a run that the
  # enabled unit started at boot is not stopped.
  proc, second = boot(script, tmp_path, env)
  assert proc.returncode == 0, proc.stderr
  assert second[1:] == ["systemctl enable midas-r", "systemctl start midas-r"], second

  # `tpu_pod.py run` stages another checkout: the run stops, the package is installed again (uv and Python
  # are on the disk), and a run that had ended (finished, say) starts again at once.
  stage_checkout(bucket, tmp_path, "# another checkout\n")
  (root / "midas-r.ended").write_text("exited 0\n")
  (tmp_path / "run" / "midas-r.last_exit").write_text("exited 75\n")
  proc, third = boot(script, tmp_path, env)
  assert proc.returncode == 0, proc.stderr
  assert third[1] == "systemctl stop midas-r" and third[-1] == "systemctl start midas-r", third
  assert [c.split()[1] for c in third if c.startswith("uv ")] == ["pip"]
  assert (root / "src" / "setup.py").read_text() == "# another checkout\n"
  assert not (root / "midas-r.ended").exists() and not (tmp_path / "run" / "midas-r.last_exit").exists()

  (root / "midas-r.ended").write_text("exited 3\n")  # halted: a reboot does not start it again
  proc, fourth = boot(script, tmp_path, env)
  assert proc.returncode == 0 and "systemctl start midas-r" not in fourth, fourth
  assert "the run ended with status exited 3" in proc.stdout

  (bucket / "midas_src.tgz").unlink()  # a stage that cannot be read: retried, then the script fails
  proc, fifth = boot(script, tmp_path, env)
  assert proc.returncode != 0 and "gave up after 8 tries" in proc.stdout
  assert sum(c.startswith("gcloud storage cp") for c in fifth) == 8 and "systemctl start midas-r" not in fifth


def make_wheel(folder, name, version, scripts=None):
  """A py3-none-any wheel of nothing but its metadata (and `scripts`, name to text), written directly."""
  dist = f"{name}-{version}"
  files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
           f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
  files.update({f"{dist}.data/scripts/{n}": text for n, text in (scripts or {}).items()})
  record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
            f"{len(text.encode())}" for path, text in files.items()] + [f"{dist}.dist-info/RECORD,,"]
  with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
    for path, text in files.items():
      info = zipfile.ZipInfo(path)
      info.external_attr = 0o100755 << 16  # a regular, executable file: pip keeps the mode
      wheel.writestr(info, text)
    wheel.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")


# uv as the test has it: `uv pip install` resolves with pip (a dry run, the same flags), the rest is noted.
PIP_AS_UV = """#!/bin/bash
echo "uv $*" >> "$CALLS"
case "$1" in
  venv) mkdir -p "$4/bin" && ln -sf "$REAL_PYTHON" "$4/bin/python" ;;
  pip) shift 2; args=(); while [ $# -gt 0 ]; do
         case "$1" in --python) shift 2 ;; -q) shift ;; *) args+=("$1"); shift ;; esac; done
       "$REAL_PYTHON" -m pip install --dry-run --no-build-isolation "${args[@]}" >> "$UV_PIP_OUT" 2>&1 ;;
esac
"""


def test_a_boot_installs_from_the_staged_wheelhouse_without_a_package_index(tmp_path):
  script, env, bucket, root = startup_sandbox(tmp_path)
  wheelhouse = bucket / _tpu_worker.WHEELHOUSE
  make_wheel(wheelhouse, "uv", _tpu_worker.UV_VERSION, scripts={"uv": PIP_AS_UV})
  for name, version in (("midasdep", "1.0"), ("midasdep", "2.0"), ("midastpu", "3.0")):
    make_wheel(wheelhouse, name, version)
  checkout = tmp_path / "checkout"
  (checkout / "requirements").mkdir()
  (checkout / "requirements" / "constraints.txt").write_text("midasdep==1.0\n")
  stage_checkout(bucket, tmp_path, "from setuptools import setup\nsetup(name='checkout', version='0.1', "
                 "py_modules=[], install_requires=['midasdep'], extras_require={'tpu': ['midastpu']})\n")
  os.remove(tmp_path / "bin" / "python3")  # the real pip: it installs uv from the wheelhouse
  os.symlink(sys.executable, tmp_path / "bin" / "python3")
  closed = "http://127.0.0.1:9/simple"  # the discard port: nothing answers there
  env = dict(env, REAL_PYTHON=sys.executable, UV_PIP_OUT=str(tmp_path / "pip.log"), PIP_CONFIG_FILE=os.devnull,
             PIP_INDEX_URL=closed, UV_INDEX_URL=closed, PIP_RETRIES="0", PIP_TIMEOUT="2", RETRY_TRIES="2")
  proc, calls = boot(script, tmp_path, env)
  assert proc.returncode == 0, proc.stdout + proc.stderr + (tmp_path / "pip.log").read_text()
  assert os.access(root / "uv" / "bin" / "uv", os.X_OK)  # uv, installed by pip from the wheelhouse
  resolved = (tmp_path / "pip.log").read_text()
  assert "Would install checkout-0.1 midasdep-1.0 midastpu-3.0" in resolved, resolved  # constrained, with the extra
  assert calls[-1] == "systemctl start midas-r"

  # Without the wheelhouse the same boot needs the index, and fails: nothing answers there.
  shutil.rmtree(root)
  script.write_text(_tpu_worker.startup_script("gs://b/stage", "midas-r", "tpu", wheelhouse=False))
  proc, calls = boot(script, tmp_path, dict(env, RETRY_TRIES="1"))
  assert proc.returncode != 0 and "gave up after 1 tries: python3 -m pip install" in proc.stdout, proc.stdout
  assert "systemctl start midas-r" not in calls


# --- GKE ---------------------------------------------------------------------------------------------------


def test_gke_applies_a_jobset_with_one_pod_per_host_of_every_slice():
  notes, cmds = dry_run("gke.py", "apply", "--dry-run", "--name=m1b", "--image=img:v1", "--accelerator=v5p-128",
                        "--slices=2", "--spot", "--service_account=trainer", "--env=A=1", "--", *GS_MIDAS)
  path = cmds[-1][-1]
  assert cmds == [["kubectl", "apply", "-f", path]]
  jobset = yaml.safe_load(written(notes, path))
  assert jobset["kind"] == "JobSet" and jobset["metadata"]["name"] == "m1b"
  spec = jobset["spec"]
  assert spec["failurePolicy"]["maxRestarts"] == 20  # a preempted node re-creates the job, the run resumes
  assert spec["failurePolicy"]["rules"] == [{"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]
  (slice_job,) = spec["replicatedJobs"]
  assert slice_job["replicas"] == 2
  job = slice_job["template"]["spec"]
  assert job["parallelism"] == job["completions"] == 16 and job["backoffLimit"] == 0  # v5p-128: 16 hosts
  rules = job["podFailurePolicy"]["rules"]  # what each exit status does: tests/test_unit_restarts.py
  assert [(r["action"], r.get("onExitCodes", {}).get("values")) for r in rules] == [
      ("FailJob", [2, 3]), ("Ignore", [76]), ("Ignore", None)]
  pod = job["template"]["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                 "cloud.google.com/gke-tpu-topology": "4x4x4", "cloud.google.com/gke-spot": "true"}
  assert pod["serviceAccountName"] == "trainer" and pod["restartPolicy"] == "Never"
  (container,) = pod["containers"]
  assert container["image"] == "img:v1" and container["command"] == ["python", "-m", "midas_jax", *GS_MIDAS]
  assert container["resources"]["limits"]["google.com/tpu"] == 4
  env = {e["name"]: e["value"] for e in container["env"]}
  assert env == {"A": "1", "MIDAS_JAX_CACHE_DIR": "gs://bucket/xla_cache", "MIDAS_TPU_ACCELERATOR": "v5p-128",
                 "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("accelerator,shape", [
    ("v5p-128", ("tpu-v5p-slice", "4x4x4", 16, 4)), ("v4-64", ("tpu-v4-podslice", "2x4x4", 8, 4)),
    ("v5e-64", ("tpu-v5-lite-podslice", "8x8", 16, 4)), ("v5litepod-256", ("tpu-v5-lite-podslice", "16x16", 64, 4)),
    ("v5e-8", ("tpu-v5-lite-podslice", "2x4", 1, 8)), ("v6e-4", ("tpu-v6e-slice", "2x2", 1, 4)),
])
def test_gke_slice_shapes(accelerator, shape):
  assert gke.slice_shape(accelerator) == shape


@pytest.mark.parametrize("action,expected", [
    ("logs", ["kubectl", "logs", "--follow"]), ("delete", ["kubectl", "delete", "jobset", "m"]),
    ("build", ["docker", "build", "-f"]),
])
def test_gke_single_actions(action, expected):
  _, cmds = dry_run("gke.py", action, "--dry-run", "--name=m", "--image=img:v1")
  assert cmds[0][:len(expected)] == expected
  if action == "build":
    assert cmds[0][-1] == REPO_ROOT and cmds[1] == ["docker", "push", "img:v1"]


def test_gke_refuses_an_unknown_accelerator_or_a_topology_of_another_size():
  for flags, message in ((["--accelerator=tpu9-8"], "--accelerator"), (["--accelerator=v5p-128", "--topology=2x2x2"],
                                                                       "--topology")):
    proc = subprocess.run([sys.executable, "launch/gke.py", "manifest", "--image=i", *flags, "--", *GS_MIDAS],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# --- what a worker installs ---------------------------------------------------------------------------------


def setup_py():
  """(CORE, EXTRAS, python_requires) as setup.py states them, read without running it."""
  tree = ast.parse(open(os.path.join(REPO_ROOT, "setup.py")).read())
  found = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
      found[node.targets[0].id] = ast.literal_eval(node.value)
    if isinstance(node, ast.keyword) and node.arg == "python_requires":
      found["python_requires"] = ast.literal_eval(node.value)
  return found["CORE"], found["EXTRAS"], found["python_requires"]


def test_python_requires_is_what_the_pinned_wheels_require():
  core, _, python_requires = setup_py()
  ours = SpecifierSet(python_requires)
  pins = dict(line.split("#")[0].split(";")[0].strip().split("==") for line in
              open(os.path.join(REPO_ROOT, "requirements", "constraints.txt")) if "==" in line.split("#")[0])
  needed = {}
  for name in (re.match(r"[\w.-]+", requirement).group(0) for requirement in core):  # the core's pins
    version = pins[name]
    if importlib.metadata.version(name).split("+")[0] != version:
      continue  # not this version here: its metadata does not speak for the pin
    needed[name] = SpecifierSet(importlib.metadata.metadata(name).get("Requires-Python") or "")
  assert {"jax", "numpy", "flax"} <= set(needed)
  for minor in range(8, 16):
    python = f"3.{minor}"
    refusing = [name for name, spec in needed.items() if python not in spec]
    assert (python in ours) == (not refusing), f"python_requires={python_requires!r} vs {python}: {refusing}"
  readme = open(os.path.join(REPO_ROOT, "README.md")).read()
  lowest = min(f"3.{m}" for m in range(8, 16) if f"3.{m}" in ours)
  assert f"Python {lowest}+" in readme and re.findall(r"Python (3\.\d+)\+", readme) == [lowest]


HEAVY = ("tensorflow", "tensorflow_datasets", "tensorflow_text", "seqio", "apache_beam", "torch", "transformers")
STORE_RUN = """
import sys
for name in {heavy}:
  sys.modules[name] = None  # as if not installed: importing one fails
from midas_jax import cli
sys.exit(cli.main(["train", "--gin_file={gin}", "--workdir={workdir}"]))
"""


def test_a_run_on_a_prepared_store_needs_only_the_core_and_the_tpu_extra(tmp_path):
  _, extras, _ = setup_py()
  for name in extras["tpu"]:  # what tpu_pod.py and the Dockerfile install on a pod's workers
    assert not any(heavy.replace("_", "-") in name.lower() for heavy in HEAVY + ("tensorflow",)), name
  documents = {s: tokenize_documents(text_files.load_documents(DataConfig(), s), ByteVocabulary(128))[:200]
               for s in ("train", "validation")}
  writer.write_store(str(tmp_path / "store"), documents, ByteVocabulary(128),
                     store_format.source_description(DataConfig()), documents_per_shard=64)
  gin = tmp_path / "run.gin"
  gin.write_text("\n".join([
      "DataConfig.source = 'prepared'", f"DataConfig.prepared_dir = '{tmp_path / 'store'}'",
      "DataConfig.vocab = 'byte'", "DataConfig.seq_len = 32", "DataConfig.batch_size = 8",
      "ModelConfig.family = 'llama'", "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2",
      "ModelConfig.num_heads = 4", "ModelConfig.num_kv_heads = 2", "ModelConfig.d_ff = 64",
      "ModelConfig.max_seq_len = 64", "ModelConfig.dtype = 'float32'", "TrainerConfig.num_steps = 2",
      "TrainerConfig.log_every = 1", "TrainerConfig.eval_every = 2", "TrainerConfig.eval_batches = 1",
      "TrainerConfig.progress_bar = False", "TrainerConfig.peak_flops_per_device = 1e11", ""]))
  code = STORE_RUN.format(heavy=HEAVY, gin=gin, workdir=tmp_path / "run")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu",
                                 XLA_FLAGS="--xla_force_host_platform_device_count=2"))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  assert '"steps": 2' in proc.stdout


FAKE_GCLOUD = """#!/bin/bash
echo "$*" >> "$CALLS"
case "$4" in
  describe)  # the next state from the list; an empty line is a resource that is not there
    state=$(head -n 1 "$STATES"); sed -i 1d "$STATES"; [ -n "$state" ] && echo "$state" || exit 1 ;;
  create)  # fails as many times as FAILS says first
    n=$(cat "$FAILS"); if [ "$n" -gt 0 ]; then echo $((n - 1)) > "$FAILS"; exit 1; fi ;;
esac
"""


def test_tpu_pod_watch_queues_again_after_a_preemption_until_the_resource_is_gone(tmp_path):
  (tmp_path / "gcloud").write_text(FAKE_GCLOUD)
  (tmp_path / "gcloud").chmod(0o755)
  # queued already; preempted; its re-queue fails once, then goes through; active; then deleted by the user
  (tmp_path / "states").write_text("ACTIVE\nSUSPENDED\n\nWAITING_FOR_RESOURCES\nACTIVE\n\n\n\n")
  (tmp_path / "fails").write_text("1\n")
  proc = subprocess.run([sys.executable, "launch/tpu_pod.py", "watch", *POD, "--accelerator=v5p-8", "--spot",
                         "--poll_s=0", "--", *GS_MIDAS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", CALLS=str(tmp_path / "calls"),
                                 STATES=str(tmp_path / "states"), FAILS=str(tmp_path / "fails"),
                                 TMPDIR=str(tmp_path)))
  assert proc.returncode == 1 and "stopped watching" in proc.stderr, proc.stdout + proc.stderr
  calls = [c.split()[3] for c in (tmp_path / "calls").read_text().splitlines() if not c.startswith("storage cat")]
  assert calls == ["describe"] * 2 + ["delete", "create"] + ["describe", "create"] + ["describe"] * 5
  assert "SUSPENDED" in proc.stdout and "WAITING_FOR_RESOURCES" in proc.stdout
