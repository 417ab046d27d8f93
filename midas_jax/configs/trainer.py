"""The loop (how long, how often to log and evaluate) and when it saves."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from midas_jax.errors import require


# 'jsonl' is always on (metrics.jsonl is the record of truth); naming it changes nothing.
TRACKERS = ("tensorboard", "wandb", "jsonl")
WANDB_MODES = (None, "online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """The loop: how long, how often to log and evaluate, and the MFU denominator.

  peak_flops_per_device: None takes a known accelerator's bf16 peak, or on CPU measures a matmul.
  progress_bar: None (the default) draws a bar on stderr only when stderr is a terminal; True
    draws it anyway (into a log file it redraws once a minute), False never.
  profile_steps: (start, stop) writes a jax.profiler trace of steps start+1 .. stop under
    <workdir>/profile (`midas train --profile=START:STOP`); None traces nothing.
  microbatches: gradient accumulation: each step's batch is split into this many microbatches whose
    gradients are summed in float32 inside the compiled step (the same loss and update as one pass
    over the whole batch, at the activation memory of one microbatch). DataConfig.batch_size must
    divide by microbatches x the mesh's data x fsdp. The gradient's reductions over the `data` axis
    (with its cross-slice part) run once per step, after the last microbatch.
  defer_fsdp_reduction: with microbatches, also reduce over the `fsdp` axis once per step (not once
    per microbatch and layer), at the memory of the whole parameters and a float32 gradient sum on
    every device instead of their fsdp shards (docs/training.md#which-gradient-reductions-run-once-per-step).
  loss_chunk: the loss (cross-entropy and z-loss) runs over the sequence in chunks of this many
    positions, recomputing each chunk's logits in the backward pass, so the float32 logits are held
    for one chunk at a time; 0 computes them for the whole sequence at once.
  shared_filesystem: local paths (the workdir, DataConfig.prepared_dir) are on a filesystem every
    machine of a multi-machine run mounts (NFS, Filestore, GCS FUSE). Without it such a run refuses
    local paths at start (train/shared_paths.py); processes on one machine share it anyway.
  metrics_flush_seconds: on an object store, records are stored by a background thread this often
    (at least 1 s: GCS takes about one update per second to one object); at a checkpoint save the
    records so far are stored at once (a resume from it finds them), and a normal exit and a
    preemption store the rest (train/metrics.py).
  trackers: where the records go besides metrics.jsonl (always written: the record of truth), any of
    TRACKERS: 'tensorboard' (events under <workdir>/tensorboard) and 'wandb' (Weights & Biases, from
    process 0; `pip install midas_jax[wandb]`). () writes metrics.jsonl alone (train/trackers/).
  wandb_project, wandb_entity, wandb_name, wandb_tags, wandb_mode: the W&B run's project, entity (None:
    your default), display name (None: the workdir's name), tags, and mode ('online', 'offline',
    'disabled'; None: wandb's own default, WANDB_MODE or online).
  """

  num_steps: int = 1000
  seed: int = 0
  log_every: int = 50
  eval_every: int = 250
  eval_batches: int = 4
  peak_flops_per_device: Optional[float] = None
  progress_bar: Optional[bool] = None
  microbatches: int = 1
  defer_fsdp_reduction: bool = False
  loss_chunk: int = 512
  profile_steps: Optional[Tuple[int, int]] = None
  shared_filesystem: bool = False
  metrics_flush_seconds: float = 5.0
  trackers: Tuple[str, ...] = ("tensorboard",)
  wandb_project: str = "midas_jax"
  wandb_entity: Optional[str] = None
  wandb_name: Optional[str] = None
  wandb_tags: Tuple[str, ...] = ()
  wandb_mode: Optional[str] = None

  def __post_init__(self):
    s = "TrainerConfig."
    require(isinstance(self.microbatches, int) and self.microbatches >= 1, s + "microbatches",
            f"must be a positive int, got {self.microbatches!r}", "1 turns gradient accumulation off")
    require(isinstance(self.defer_fsdp_reduction, bool), s + "defer_fsdp_reduction",
            f"must be True or False, got {self.defer_fsdp_reduction!r}",
            "False keeps the parameters and gradients fsdp-sharded (ZeRO-3)")
    require(isinstance(self.loss_chunk, int) and self.loss_chunk >= 0, s + "loss_chunk",
            f"must be an int >= 0, got {self.loss_chunk!r}", "512 is the default; 0 turns chunking off")
    if self.profile_steps is not None:
      ok = len(self.profile_steps) == 2 and 0 <= self.profile_steps[0] < self.profile_steps[1] <= self.num_steps
      require(ok, s + "profile_steps", f"must be (start, stop) with 0 <= start < stop <= num_steps, got "
              f"{self.profile_steps}", "trace a few steps after the first compile, e.g. (5, 8)")
    require(self.num_steps > 0, s + "num_steps", "must be > 0", "set the number of training steps")
    require(self.log_every > 0, s + "log_every", "must be > 0", "log every N >= 1 steps")
    require(self.eval_every >= 0, s + "eval_every", "must be >= 0", "0 turns periodic eval off")
    require(self.eval_batches > 0, s + "eval_batches", "must be > 0", "evaluate on >= 1 batch")
    require(self.metrics_flush_seconds >= 1, s + "metrics_flush_seconds",
            f"must be >= 1, got {self.metrics_flush_seconds!r}",
            "GCS takes about one update per second to one object; 5 is the default")
    self._check_trackers()

  def _check_trackers(self):
    s = "TrainerConfig."
    for name in ("trackers", "wandb_tags"):  # a single name, or a gin list, as the tuple the frozen config holds
      value = getattr(self, name)
      if isinstance(value, (str, list)):
        object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
    names = self.trackers
    require(isinstance(names, tuple) and all(isinstance(n, str) for n in names), s + "trackers",
            f"must be a tuple of names, got {names!r}", f"e.g. ('tensorboard', 'wandb'); the names: {TRACKERS}")
    unknown = [n for n in names if n not in TRACKERS]
    require(not unknown, s + "trackers", f"unknown tracker(s) {unknown}", f"choose among {TRACKERS}")
    require(len(set(names)) == len(names), s + "trackers", f"names a tracker twice: {names!r}", "name each once")
    require(self.wandb_mode in WANDB_MODES, s + "wandb_mode", f"must be one of {WANDB_MODES}, got "
            f"{self.wandb_mode!r}", "None leaves it to wandb (WANDB_MODE, else online)")
    require(isinstance(self.wandb_tags, tuple) and all(isinstance(t, str) for t in self.wandb_tags),
            s + "wandb_tags", f"must be a tuple of strings, got {self.wandb_tags!r}", "e.g. ('midas', '1b')")
    require(isinstance(self.wandb_project, str) and self.wandb_project, s + "wandb_project",
            f"must be a non-empty string, got {self.wandb_project!r}", "e.g. 'midas_jax'")


NO_USABLE_SAVE = ("error", "start_fresh")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When a run saves (orbax, under <workdir>/checkpoints) and which saves it keeps.

  every: save every N steps (0: only at stage boundaries, at the end and on preemption, which
    always save). keep: the newest saves kept; keep_every: also keep every save whose step is a
    multiple of this (None: none kept beyond `keep`). async_save: write in a background thread while
    training goes on (the run always waits for it before exiting).
  init_from: a params-only export (or a run's workdir) whose parameters start a new run, e.g. an
    imported Hugging Face model; ignored when the workdir already has checkpoints (resume wins).
  restore_retries, restore_timeout_s: a restore (or listing of the saves) that meets a storage error (HTTP
    408/429/5xx, a reset or timed-out connection, refused credentials) is tried again after 1, 2, 4, ... s
    (at most 60 s apart) up to restore_retries times, and no new try starts restore_timeout_s seconds after
    the first; then the run stops with the storage error (exit status 75), leaving the save as it is. A try
    that is running is not cut short: the storage clients retry on their own first (gcsfs about 30 s,
    tensorstore's array reads up to about 15 minutes).
  on_no_usable_save: when saves exist and none can be used (each damaged, and set aside), "error" stops the
    run listing them and why; "start_fresh" starts from step 0 (or init_from) with a warning.
  local_dir: emergency checkpoints (checkpoint/emergency.py, docs/pods.md#emergency-checkpoints): a directory
    on each host's own fast disk (local SSD or a ramdisk, never a bucket) where every process also keeps its
    own shards of the state every local_every steps, the newest local_keep of them, beside the saves under
    the workdir (the persistent tier, unchanged). A resume takes the newest step complete in either tier: a
    local save counts only where every process still has its part. None (the default): no local tier.
  """

  every: int = 1000
  keep: int = 3
  keep_every: Optional[int] = None
  async_save: bool = True
  init_from: Optional[str] = None
  restore_retries: int = 6
  restore_timeout_s: float = 600.0
  on_no_usable_save: str = "error"
  local_dir: Optional[str] = None
  local_every: int = 100
  local_keep: int = 2

  def __post_init__(self):
    s = "CheckpointConfig."
    require(self.every >= 0, s + "every", "must be >= 0", "0 saves only at stage ends, the end and preemption")
    require(self.keep >= 1, s + "keep", "must be >= 1", "keep at least the newest checkpoint")
    require(self.keep_every is None or self.keep_every >= 1, s + "keep_every", "must be >= 1 or None",
            "e.g. 10000 keeps every 10000th step's save")
    require(self.restore_retries >= 0, s + "restore_retries", f"must be >= 0, got {self.restore_retries}",
            "6 waits out an outage of a few minutes; 0 stops at the first storage error the clients give up on")
    require(self.restore_timeout_s > 0, s + "restore_timeout_s", f"must be > 0, got {self.restore_timeout_s}",
            "600 (10 minutes) waits out a short storage outage before the run stops")
    require(self.on_no_usable_save in NO_USABLE_SAVE, s + "on_no_usable_save",
            f"must be one of {NO_USABLE_SAVE}, got {self.on_no_usable_save!r}",
            "'error' stops when every save is damaged; 'start_fresh' starts from step 0 instead")
    require(self.local_dir is None or (bool(self.local_dir) and "://" not in self.local_dir), s + "local_dir",
            f"must be a directory on the host's own disk, got {self.local_dir!r}",
            "a local SSD or ramdisk path such as '/mnt/disks/ssd/midas' or '/dev/shm/midas'; the bucket already "
            "holds the persistent saves (every); None turns the local tier off")
    require(self.local_every >= 1, s + "local_every", f"must be >= 1, got {self.local_every}",
            "the steps between two local saves, e.g. 100 (a few seconds of a step's time each)")
    require(self.local_keep >= 1, s + "local_keep", f"must be >= 1, got {self.local_keep}",
            "2 keeps the newest local save and the one before it")
