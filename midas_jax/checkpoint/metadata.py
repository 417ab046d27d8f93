"""What a checkpoint says about itself, and whether a config may resume from it.

Every save carries JSON metadata (docs/architecture.md#checkpoints-carry-their-meaning): the resolved RunConfig, the operative gin
config, stage, depth, layer lineage and growths, the data seed and step, and package versions. A
resume compares the saved config with the new one: operational settings (mesh, logging, evaluation
cadence, checkpoint policy) may change freely; anything that changes what is trained needs an
explicit allowance, so a typo cannot silently continue a different experiment. A save also holds
`trackers`: what an experiment tracker needs to continue its run after a resume (the W&B run id).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

from midas_jax import configs, versions
from midas_jax.errors import ConfigError

FORMAT_VERSION = 1

# Settings that do not change what is trained: a resume may change them without an allowance.
# How a step is computed (attention kernel, gradient accumulation, loss chunks) is among them.
OPERATIONAL = ("mesh.", "trainer.log_every", "trainer.eval_every", "trainer.eval_batches",
               "trainer.progress_bar", "trainer.peak_flops_per_device", "trainer.profile_steps",
               "trainer.microbatches", "trainer.loss_chunk", "model.attention", "model.matmul_operands",
               "data.prefetch", "data.read_threads", "data.read_merge_gap_bytes", "data.read_retry_timeout_s",
               "checkpoint.", "trainer.trackers", "trainer.wandb_project",
               "trainer.wandb_entity", "trainer.wandb_name", "trainer.wandb_tags", "trainer.wandb_mode")

_PACKAGES = ("midas_jax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def package_versions() -> Dict[str, str]:
  return versions.installed(_PACKAGES)


def _jsonable(value: Any) -> Any:
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, dict):
    return {k: _jsonable(v) for k, v in value.items()}
  return value


def config_to_dict(config: configs.RunConfig) -> Dict[str, Any]:
  return _jsonable(dataclasses.asdict(config))


def _tuples(value: Any) -> Any:
  """JSON lists back to the tuples the frozen configs hold."""
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  return value


def _sections() -> Dict[str, str]:
  """{config class name: its RunConfig field}, e.g. {"DataConfig": "data"}."""
  return {f.default_factory.__name__: f.name for f in dataclasses.fields(configs.RunConfig)}


def _moved_to_their_sections(d: Dict[str, Any]) -> Dict[str, Any]:
  """A config saved before settings moved (configs.MOVED_SETTINGS), with them where they are now."""
  sections = _sections()
  d = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
  for old, new in configs.MOVED_SETTINGS.items():
    (old_class, name), (new_class, new_name) = old.split("."), new.split(".")
    saved = d.get(sections[old_class], {})
    if isinstance(saved, dict) and name in saved:
      d.setdefault(sections[new_class], {}).setdefault(new_name, saved.pop(name))
  return d


def config_from_dict(d: Dict[str, Any]) -> configs.RunConfig:
  """The RunConfig saved by config_to_dict (fields this version does not know are dropped; settings
  that have moved since are read where they are now)."""
  d = _moved_to_their_sections(d)
  parts = {}
  for field in dataclasses.fields(configs.RunConfig):
    cls = field.default_factory  # every RunConfig field is a config dataclass
    known = {f.name for f in dataclasses.fields(cls)}
    parts[field.name] = cls(**{k: _tuples(v) for k, v in d.get(field.name, {}).items() if k in known})
  return configs.RunConfig(**parts)


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def config_differences(saved: Dict[str, Any], new: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
  """(dotted key, saved value, new value) for every setting that differs."""
  a, b = _flatten(_jsonable(saved)), _flatten(_jsonable(new))
  return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def check_resumable(saved: Dict[str, Any], new: Dict[str, Any], allowed: Sequence[str] = ()) -> List[str]:
  """Refuses (ConfigError listing them) differences that are neither operational nor allowed.

  allowed: dotted keys such as "optimizer.learning_rate" or section prefixes such as "optimizer.";
  "all" allows everything. Returns the differences that were accepted, for the log.
  """
  accepted, refused = [], []
  # A setting added since the save was made reads as its default, which is what that run used.
  saved = config_to_dict(config_from_dict(saved))
  for key, old, value in config_differences(saved, new):
    line = f"{key}: {old!r} -> {value!r}"
    ok = "all" in allowed or any(key == p or (p.endswith(".") and key.startswith(p))
                                 for p in tuple(allowed) + OPERATIONAL)
    (accepted if ok else refused).append(line)
  if refused:
    raise ConfigError(
        "--allow_config_changes",
        "the workdir's checkpoint was trained with a different config:\n  " + "\n  ".join(refused),
        "resume with the saved settings, use a new --workdir, or allow the changes explicitly with "
        "--allow_config_changes=" + ",".join(line.split(":")[0] for line in refused))
  return accepted
