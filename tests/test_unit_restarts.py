"""What each exit status does under each launcher (docs/pods.md#exit-statuses): the TPU VM's systemd unit run
through a stand-in for systemd, the JobSet's pod failure policy through a stand-in for the Job controller,
and the documented table checked against midas_jax/exit_status.py.

The stand-in systemd reads the rendered unit as systemd does for the settings it uses (Restart=,
RestartSec=, RestartPreventExitStatus=, SuccessExitStatus=, StartLimit*=, ConditionPathExists=,
[Install]) and runs its ExecStartPre= and ExecStopPost= commands for real, with `sleep` replaced by a
stand-in that notes how long it would have slept.
"""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from midas_jax import exit_status
from test_pod_launch import GS_MIDAS, boot, startup_sandbox

sys.path.insert(0, os.path.join(REPO_ROOT, "launch"))
import _tpu_worker  # noqa: E402  pylint: disable=wrong-import-position
import gke  # noqa: E402  pylint: disable=wrong-import-position

CLEAN_SIGNALS = ("HUP", "INT", "TERM", "PIPE")  # systemd counts these deaths of a service as clean
RESTART_ON = {  # Restart= value: the kinds of ending it restarts (systemd.service, "Restart=")
    "no": (), "always": ("clean", "unclean-exit", "unclean-signal"), "on-success": ("clean",),
    "on-failure": ("unclean-exit", "unclean-signal"), "on-abnormal": ("unclean-signal",),
    "on-abort": ("unclean-signal",),
}


def systemd_words(value):
  """An Exec*= line's words as systemd splits and unescapes them (double quotes, backslashes, $$ and %%)."""
  words = []
  for quoted, bare in re.findall(r'"((?:[^"\\]|\\.)*)"|(\S+)', value):
    word = re.sub(r"\\(.)", r"\1", quoted) if quoted or not bare else bare
    words.append(word.replace("$$", "$").replace("%%", "%"))
  return words


class StandInSystemd:
  """One service unit's life: starts, endings, restarts, `systemctl stop`, `enable` and reboots."""

  def __init__(self, text, folder):
    self.settings = {}
    section = None
    for line in text.splitlines():
      if line.startswith("[") and line.endswith("]"):
        section = line[1:-1]
      elif "=" in line and not line.startswith("#"):
        key, value = line.split("=", 1)
        self.settings.setdefault((section, key), []).append(value)
    self.folder, self.sleeps = folder, folder / "sleeps"
    (folder / "bin").mkdir(exist_ok=True)
    (folder / "bin" / "sleep").write_text('#!/bin/sh\necho "$1" >> "$SLEEPS"\n')
    (folder / "bin" / "sleep").chmod(0o755)
    self.enabled, self.clock, self.starts, self.state = False, 0.0, [], "inactive"

  def one(self, section, key, default=None):
    return self.settings.get((section, key), [default])[-1]

  def _run(self, key, env):
    """Runs the unit's Exec<key>= commands; returns the seconds their `sleep`s add up to."""
    self.sleeps.write_text("")
    for value in self.settings.get(("Service", key), []):
      words = systemd_words(value.lstrip("-@+!"))
      proc = subprocess.run(words, env=dict(env, PATH=f"{self.folder / 'bin'}:/usr/bin:/bin", SLEEPS=str(self.sleeps)),
                            capture_output=True, text=True, timeout=30)
      assert proc.returncode == 0 or value.startswith("-"), proc.stderr
    return sum(float(s) for s in self.sleeps.read_text().split())

  def start(self):
    """A start job: the conditions, the start rate limit, then ExecStartPre=. False when refused or skipped."""
    for condition in self.settings.get(("Unit", "ConditionPathExists"), []):
      negate, path = condition.startswith("!"), condition.lstrip("!")
      if os.path.exists(path) == negate:
        self.state = "inactive (condition)"
        return False
    interval, burst = float(self.one("Unit", "StartLimitIntervalSec", 10)), int(self.one("Unit", "StartLimitBurst", 5))
    self.starts = [t for t in self.starts if t > self.clock - interval]
    if len(self.starts) >= burst:
      self.state = "failed (start-limit-hit)"
      return False
    self.starts.append(self.clock)
    self.clock += self._run("ExecStartPre", {})
    self.state = "active"
    return True

  def _kind(self, code, status):
    success = {"0"} | set(" ".join(self.settings.get(("Service", "SuccessExitStatus"), [])).split())
    if code == "exited":
      return "clean" if str(status) in success else "unclean-exit"
    return "clean" if status in CLEAN_SIGNALS else "unclean-signal"

  def ended(self, code, status, run_s=600.0, stopped=False):
    """The main process ended (`code` exited or killed); returns the seconds until the next run, or None."""
    assert self.state == "active", self.state
    self.clock += run_s
    self._run("ExecStopPost", {"EXIT_CODE": code, "EXIT_STATUS": str(status)})
    kind = self._kind(code, status)
    prevented = str(status) in " ".join(self.settings.get(("Service", "RestartPreventExitStatus"), [])).split()
    if stopped or prevented or kind not in RESTART_ON[self.one("Service", "Restart", "no")]:
      self.state = "inactive" if kind == "clean" else "failed"
      return None
    before = self.clock
    self.clock += float(self.one("Service", "RestartSec", 0.1))
    return self.clock - before if self.start() else None

  def reboot(self, run_dir):
    """A boot: /run is emptied, the rate limit forgotten, and an enabled unit wanted by the boot's target started."""
    for name in os.listdir(run_dir):
      os.remove(os.path.join(run_dir, name))
    self.starts, self.state = [], "inactive"
    if self.enabled and "multi-user.target" in self.one("Install", "WantedBy", ""):
      return self.start()
    return False


@pytest.fixture(name="worker")
def fixture_worker(tmp_path):
  """The rendered unit on a worker whose start-up script has run once (in a sandbox), as systemd would have it."""
  script, env, _, root = startup_sandbox(tmp_path)
  proc, calls = boot(script, tmp_path, env)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  text = (tmp_path / "units" / "midas-r.service").read_text()
  text = text.replace(_tpu_worker.last_exit_file("r"), str(tmp_path / "run" / "midas-r.last_exit"))
  systemd = StandInSystemd(text, tmp_path)
  systemd.enabled = "systemctl enable midas-r" in calls
  assert systemd.start()
  return systemd, tmp_path / "run", root


ENDINGS = [("exited", c.status) for c in exit_status.ALL] + [("killed", "KILL"), ("dumped", "ABRT")]


@pytest.mark.parametrize("code,status", ENDINGS)
def test_each_exit_class_is_restarted_as_the_table_says(worker, code, status):
  systemd, run_dir, _ = worker
  delay = systemd.ended(code, status)
  rule = next((c.restart for c in exit_status.ALL if c.status == status), "after a delay")  # a signal: a failure's
  if rule.startswith("never"):
    assert delay is None and systemd.state in ("inactive", "failed"), (status, delay)
    assert systemd.reboot(run_dir) is False  # a finished, refused or halted run stays down after a reboot too
    return
  assert delay is not None, (status, systemd.state)
  if rule == "now":
    assert delay <= 10, delay
  else:
    assert delay >= 30, delay
  if status == exit_status.STORAGE_UNAVAILABLE.status:  # an outage waits longer than a failure or a preemption
    assert delay > _tpu_worker.RESTART_DELAY_S[exit_status.FAILED.status] > _tpu_worker.RESTART_SEC
  assert systemd.state == "active"
  assert systemd.reboot(run_dir) is True and systemd.clock - systemd.starts[-1] == 0  # a boot starts it at once


def test_a_finished_run_is_not_restarted_and_a_stopped_one_starts_again_at_boot(worker):
  systemd, run_dir, root = worker
  assert systemd.ended("exited", exit_status.FINISHED.status) is None and systemd.state == "inactive"
  assert systemd.reboot(run_dir) is False
  (root / "midas-r.ended").unlink()  # `tpu_pod.py run`: a new stage
  assert systemd.start()
  # `tpu_pod.py stop` (systemctl stop): the run saves and exits 76, and a unit told to stop is not restarted
  assert systemd.ended("exited", exit_status.PREEMPTED.status, stopped=True) is None
  assert systemd.reboot(run_dir) is True  # enabled by the start-up script, wanted by multi-user.target


def test_a_failure_that_repeats_at_the_same_step_stops_and_restarts_are_bounded(worker):
  systemd, run_dir, root = worker
  assert systemd.ended("exited", exit_status.FAILED.status) is not None
  assert systemd.ended("exited", exit_status.HALTED.status) is None  # the CLI's verdict on the same step twice
  (root / "midas-r.ended").unlink()
  systemd.reboot(run_dir)
  restarts = 0
  while systemd.ended("exited", exit_status.FAILED.status, run_s=60) is not None:  # fails at once, every time
    restarts += 1
  assert restarts == _tpu_worker.START_LIMIT - 1 and systemd.state == "failed (start-limit-hit)"


def test_the_restart_delays_cover_every_class_that_restarts():
  restarting = {c.status for c in exit_status.ALL} - set(exit_status.NEVER_RESTART)
  assert set(_tpu_worker.RESTART_DELAY_S) == restarting
  assert exit_status.FINISHED.status in exit_status.NEVER_RESTART


def pod_failure_action(rules, status, disrupted=False):
  """What the Job controller does with a pod that ended with `status`: the first rule that matches, else Count."""
  if status == 0:
    return "Succeeded"
  for rule in rules:
    on_exit = rule.get("onExitCodes")
    if on_exit and (status in on_exit["values"]) == (on_exit["operator"] == "In"):
      return rule["action"]
    if any(c["type"] == "DisruptionTarget" and c.get("status", "True") == "True" and disrupted
           for c in rule.get("onPodConditions", [])):
      return rule["action"]
  return "Count"


@pytest.mark.parametrize("status", [c.status for c in exit_status.ALL] + [137])
def test_gke_maps_each_exit_class_to_its_restart_rule(status):
  rules = gke.pod_failure_rules()
  for rule in rules:  # what the API accepts: In lists sorted, without 0
    values = rule.get("onExitCodes", {}).get("values", [])
    assert values == sorted(values) and 0 not in values
  action = pod_failure_action(rules, status)
  rule = next((c.restart for c in exit_status.ALL if c.status == status), "after a delay")
  expected = {"never": "FailJob", "now": "Ignore"}.get(rule.split(":")[0], "Count")
  assert action == ("Succeeded" if status == 0 else expected), (status, action)
  assert pod_failure_action(rules, 137, disrupted=True) == "Ignore"  # a node preempted before the pod could save


def test_the_documented_table_is_exit_status_all():
  text = open(os.path.join(REPO_ROOT, "docs/pods.md")).read()
  section = text.split("\n## Exit statuses\n", 1)[1].split("\n## ", 1)[0]
  rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
          if re.match(r"\| \d+ \|", line)]
  assert [(int(row[0]), row[1]) for row in rows] == [(c.status, c.name) for c in exit_status.ALL]
  assert all(len(row) == 6 and all(row) for row in rows)  # every launcher's column filled in

