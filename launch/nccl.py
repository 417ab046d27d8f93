"""NCCL's settings for the interconnect between GPU nodes, one named profile each (`launch/slurm.py --interconnect`).

NCCL picks a transport on its own and falls back to TCP sockets, slowly and silently, when the fast one
is not set up; the right settings depend on the fabric, which nothing here can see. So none is guessed:
the user names the profile of their cluster, and each variable below carries its reason and where the
vendor documents it. What only the cluster knows (which NICs, RoCE's GID index and traffic class) is
passed with --env, e.g. --env=NCCL_IB_HCA=mlx5_0,mlx5_1; on GCP A3 Mega the NIC names
(NCCL_FASTRAK_CTRL_DEV, NCCL_FASTRAK_IFNAME, NCCL_SOCKET_IFNAME) as the cluster's page lists them.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple

NCCL_ENV_DOCS = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"
EFA_DOCS = "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start-nccl.html"
TCPXO_DOCS = "https://cloud.google.com/hpc-toolkit/docs/machine-learning/a3-mega-enable-gpudirect-tcpxo"
TCPXO_LIB = "/var/lib/tcpxo/lib64"  # where the A3 Mega images install the GPUDirect-TCPXO NCCL plugin


class Setting(NamedTuple):
  line: str  # the batch script's line
  why: str
  source: str


PROFILES: Dict[str, List[Setting]] = {
    # InfiniBand and RoCE are both NCCL's IB verbs transport.
    "ib": [
        Setting("export NCCL_IB_DISABLE=0",
                "take the IB verbs transport between nodes; an image that set 1 would fall back to TCP sockets",
                NCCL_ENV_DOCS),
        Setting("export NCCL_IB_TIMEOUT=22",
                "each retransmission waits 4.096 us x 2^22 (17 s) instead of NCCL's default 2^20 (4 s), so a "
                "congested fabric of many nodes slows a collective instead of failing the job", NCCL_ENV_DOCS),
    ],
    # AWS p4d/p5: NCCL reaches EFA through the aws-ofi-nccl plugin and libfabric (in AWS's Deep Learning AMIs).
    "efa": [
        Setting("export FI_PROVIDER=efa",
                "libfabric takes the EFA provider, not its TCP one, which it would otherwise fall back to",
                EFA_DOCS),
        Setting("export FI_EFA_USE_DEVICE_RDMA=1",
                "GPUDirect RDMA: the EFA NIC reads and writes GPU memory without a copy through the host (p4d, p5)",
                EFA_DOCS),
    ],
    # GCP A3 Mega (a3-megagpu-8g): GPUDirect-TCPXO. Its plugin ships the tuned variables as a script to source.
    "gcp-tcpxo": [
        Setting(f"export LD_LIBRARY_PATH={TCPXO_LIB}:${{LD_LIBRARY_PATH:-}}",
                "NCCL loads the TCPXO net plugin from here", TCPXO_DOCS),
        Setting(f"set +u; NCCL_LIB_DIR={TCPXO_LIB} source {TCPXO_LIB}/nccl-env-profile.sh; set -u",
                "the NCCL_FASTRAK_* and tuning variables Google publishes for this plugin version, kept with it",
                TCPXO_DOCS),
    ],
}


def script_lines(profile: str) -> List[str]:
  """The batch script's lines for `profile` ("none": NCCL's own choice), each after a comment saying why."""
  if profile == "none":
    return []
  out = [f"# NCCL for --interconnect={profile} (launch/nccl.py)"]
  for s in PROFILES[profile]:
    out += [f"# {s.why} ({s.source})", s.line]
  return out
