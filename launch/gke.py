"""Run midas on GKE TPU node pools as a JobSet: one Job per slice, one pod per TPU VM host.

  python launch/gke.py build --image=us-docker.pkg.dev/PROJECT/REPO/midas:v1
  python launch/gke.py apply --name=midas-1b --image=us-docker.pkg.dev/PROJECT/REPO/midas:v1 \\
      --accelerator=v5p-128 -- train --gin_file=gin/experiments/paper_1b_midas_prop1.gin \\
         --gin_file=gin/meshes/tpu_v5p_128.gin --workdir=gs://BUCKET/runs/paper_1b_midas_prop1

Actions: build (the image from launch/Dockerfile: Python 3.11 and `.[tpu]`, then push), manifest
(print the JobSet), apply (write it and `kubectl apply` it), logs (follow the first pod), delete
(SIGTERM to every pod: the run saves and exits). --dry-run prints the commands and the manifest.
The pods' exit statuses (docs/pods.md#exit-statuses) decide what happens: a preempted run (76), or a
pod its node's disruption killed, is replaced without using a restart; a failure (1, 75, a signal)
re-creates all of the job's pods (up to --max_restarts times); bad input or a halted run (2, 3) fails
the JobSet. Every start resumes from the workdir. jax finds its peers from the variables GKE sets in
TPU pods (TPU_WORKER_HOSTNAMES, and MEGASCALE_* across slices). Needs the JobSet controller in the
cluster, and a Kubernetes service account that may use the bucket (Workload Identity: --service_account).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Dict, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (REPO_ROOT, Runner, parse_pod_args, require_midas_args,  # noqa: E402  pylint: disable=wrong-import-position
                     split_midas_args, with_accelerator, with_compile_cache)
from midas_jax import exit_status, hardware  # noqa: E402  pylint: disable=wrong-import-position

ACTIONS = ("build", "manifest", "apply", "logs", "delete")
STOP_GRACE_S = 900  # SIGTERM makes the run save; Kubernetes waits this long before SIGKILL


def parse(argv: Sequence[str]) -> argparse.Namespace:
  own, midas_args = split_midas_args(argv)
  parser = argparse.ArgumentParser(prog="launch/gke.py", description=__doc__.split("\n")[0],
                                   epilog="Everything after `--` is the midas command every pod runs.")
  parser.add_argument("action", choices=ACTIONS)
  parser.add_argument("--name", default="midas", help="the JobSet's name")
  parser.add_argument("--image", default=None, help="the container image (build pushes it there)")
  parser.add_argument("--accelerator", default=None, help="accelerator type of each slice, e.g. v5p-128, v5e-64")
  parser.add_argument("--topology", default=None, help="the slice's chip topology (default: by accelerator)")
  parser.add_argument("--slices", type=int, default=1, help="slices joined by DCN (one node pool each)")
  parser.add_argument("--spot", action="store_true", help="schedule on Spot node pools")
  parser.add_argument("--max_restarts", type=int, default=20,
                      help="times JobSet re-creates the jobs after a failed pod (a preemption is not counted)")
  parser.add_argument("--service_account", default=None, help="Kubernetes service account of the pods")
  parser.add_argument("--namespace", default=None)
  parser.add_argument("--out", default=None, help="where apply writes the manifest (default: a temp file)")
  args = parse_pod_args(parser, own, midas_args)
  if args.action in ("build", "manifest", "apply") and not args.image:
    parser.error(f"`{args.action}` needs --image, e.g. --image=us-docker.pkg.dev/PROJECT/REPO/midas:v1")
  if args.action in ("manifest", "apply"):
    require_midas_args(parser, midas_args)
    if not args.accelerator:
      parser.error(f"`{args.action}` needs --accelerator, e.g. --accelerator=v5p-128")
    if args.slices < 1:
      parser.error("--slices must be >= 1")
    try:
      args.shape = slice_shape(args.accelerator, args.topology)
    except ValueError as e:
      parser.error(str(e))
  return args


def slice_shape(accelerator: str, topology: str = None) -> Tuple[str, str, int, int]:
  """(GKE accelerator label, topology, hosts, chips per host) of one slice of `accelerator`."""
  parsed = hardware.parse_slice(accelerator)
  if parsed is None or parsed.name != parsed.accelerator:  # one slice: --slices counts them
    raise ValueError(f"--accelerator={accelerator}: expected GENERATION-SIZE with GENERATION one of "
                     f"{', '.join(sorted(hardware.ACCELERATOR_NAMES))}")
  chips = parsed.chips
  if topology is None:
    topology = hardware.default_topology(parsed.tpu, chips)
    if topology is None:
      raise ValueError(f"--accelerator={accelerator}: no default topology for {chips} chips; pass --topology")
  product = 1
  for side in topology.split("x"):
    product *= int(side)
  if product != chips:
    raise ValueError(f"--topology={topology} has {product} chips, --accelerator={accelerator} {chips}")
  hosts, per_host = hardware.slice_hosts(parsed.tpu, chips)
  return parsed.tpu.gke_label, topology, hosts, per_host


def manifest(args) -> Dict:
  """The JobSet, as a dict (rendered as YAML by `to_yaml`)."""
  label, topology, hosts, chips_per_host = args.shape
  env = dict(with_accelerator(with_compile_cache(args.env, args.midas_args, args.compile_cache), args.accelerator),
             PYTHONUNBUFFERED="1")
  node_selector = {"cloud.google.com/gke-tpu-accelerator": label, "cloud.google.com/gke-tpu-topology": topology}
  pod = {"restartPolicy": "Never", "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
         "terminationGracePeriodSeconds": STOP_GRACE_S, "nodeSelector": node_selector}
  if args.spot:
    node_selector["cloud.google.com/gke-spot"] = "true"
    pod["tolerations"] = [{"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                           "effect": "NoSchedule"}]
  if args.service_account:
    pod["serviceAccountName"] = args.service_account
  pod["containers"] = [{
      "name": "midas", "image": args.image, "command": ["python", "-m", "midas_jax", *args.midas_args],
      "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
      "ports": [{"containerPort": 8471}, {"containerPort": 8080}],  # the TPU runtime's, as GKE's examples open
      "resources": {"limits": {"google.com/tpu": chips_per_host}},
  }]
  job = {"parallelism": hosts, "completions": hosts, "backoffLimit": 0,
         "podFailurePolicy": {"rules": pod_failure_rules()}, "template": {"spec": pod}}
  metadata = {"name": args.name,
              "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}}
  if args.namespace:
    metadata["namespace"] = args.namespace
  return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": metadata,
          "spec": {"failurePolicy": {"maxRestarts": args.max_restarts,
                                     "rules": [{"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
                   "replicatedJobs": [{"name": "slice", "replicas": args.slices, "template": {"spec": job}}]}}


def pod_failure_rules() -> List[Dict]:
  """The Job's podFailurePolicy: what a pod's ending does (docs/pods.md#exit-statuses), first match wins.

  FailJob on the never-restart statuses: JobSet's rule on the reason PodFailurePolicy fails the JobSet.
  Ignore on a preemption (76) and on a pod its node's disruption killed (DisruptionTarget): the pod is
  replaced and neither backoffLimit nor the JobSet's maxRestarts is used. Anything else is counted: with
  backoffLimit 0 the job fails and JobSet re-creates every job, one of --max_restarts. Kubernetes has no
  delay to give a storage outage (75): it restarts as a failure does. Status 0 is a success, not a
  failure, and may not be listed (the API refuses 0 with `In`).
  """
  def on_exit(action: str, statuses) -> Dict:
    return {"action": action, "onExitCodes": {"containerName": "midas", "operator": "In",
                                               "values": sorted(s for s in statuses if s != 0)}}
  return [on_exit("FailJob", exit_status.NEVER_RESTART), on_exit("Ignore", [exit_status.PREEMPTED.status]),
          {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]


def to_yaml(value, indent: int = 0) -> List[str]:
  """Block-style YAML lines; strings are JSON-quoted (valid YAML scalars), so nothing is re-typed."""
  pad = "  " * indent
  lines: List[str] = []
  if isinstance(value, dict):
    for key, item in value.items():
      if isinstance(item, (dict, list)) and item:
        lines += [f"{pad}{key}:"] + to_yaml(item, indent + 1)
      else:
        lines.append(f"{pad}{key}: {json.dumps(item)}")
  else:
    for item in value:
      nested = to_yaml(item, indent + 1) if isinstance(item, (dict, list)) else [f"{pad}  {json.dumps(item)}"]
      lines.append(f"{pad}- {nested[0].strip()}")
      lines += nested[1:]
  return lines


def render(args) -> str:
  label, topology, hosts, chips = args.shape
  header = [f"# Written by launch/gke.py: {args.slices} slice(s) of {args.accelerator} ({label}, {topology}), "
            f"{hosts} pod(s) of {chips} chips per slice.",
            "# A preempted pod is replaced, a failed one (crash, storage outage) re-creates the job, bad input or a",
            "# halted run fails the JobSet (docs/pods.md#exit-statuses); every start resumes from the workdir."]
  return "\n".join(header + to_yaml(manifest(args))) + "\n"


def kubectl(args, *rest: str) -> List[str]:
  return ["kubectl", *rest] + ([f"--namespace={args.namespace}"] if args.namespace else [])


def main(argv: Sequence[str] = None) -> int:
  args = parse(sys.argv[1:] if argv is None else argv)
  runner = Runner(args.dry_run)
  if args.action == "build":
    runner.run(["docker", "build", "-f", os.path.join(REPO_ROOT, "launch", "Dockerfile"), "-t", args.image, REPO_ROOT])
    runner.run(["docker", "push", args.image])
  elif args.action == "manifest":
    print(render(args), end="")
  elif args.action == "apply":
    path = args.out or os.path.join(tempfile.gettempdir(), f"midas_jobset_{args.name}.yaml")
    runner.write(path, render(args))
    runner.run(kubectl(args, "apply", "-f", path))
  elif args.action == "logs":
    first = (f"jobset.sigs.k8s.io/jobset-name={args.name},jobset.sigs.k8s.io/job-index=0,"
             "batch.kubernetes.io/job-completion-index=0")
    runner.run(kubectl(args, "logs", "--follow", f"--selector={first}"), check=False)
  else:
    runner.run(kubectl(args, "delete", "jobset", args.name))
  return 0


if __name__ == "__main__":
  sys.exit(main())
