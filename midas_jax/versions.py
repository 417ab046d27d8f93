"""The versions of installed packages, recorded beside what they produced (checkpoints, stores)."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Dict, Sequence


def installed(names: Sequence[str]) -> Dict[str, str]:
  """Python's version and each named distribution's ("not installed" where it is not)."""
  versions = {"python": platform.python_version()}
  for name in names:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = "not installed"
  return versions
