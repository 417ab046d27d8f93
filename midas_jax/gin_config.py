"""gin at the edges: registers the config dataclasses and turns gin files and bindings into configs.

Modules never read gin; only the entry points call `parse`, then `run_config_from_gin` or `build`.
The config classes are registered with `gin.register`, which leaves the classes themselves alone:
`ModelConfig(...)` means its defaults everywhere, whatever was parsed, and only a config built here
(through gin's configurable version of the class) takes the bound values. The run's sections
(configs.CONFIG_CLASSES) are registered here; the studies' configs, on a floor above, register
themselves with `register` where they are defined (studies/anchor_config.py, studies/stacking_config.py).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import inspect
import logging
import os
import re
from typing import Iterable, List, Sequence, Type, TypeVar

import gin

from midas_jax import configs, fs
from midas_jax.errors import ConfigError

T = TypeVar("T")
_REGISTERED: List[type] = []  # every config class gin binds, in registration order


def gin_search_paths() -> List[str]:
  """The repository's gin/ folder (installed as package data midas_jax/gin_configs) and the cwd."""
  here = os.path.dirname(os.path.abspath(__file__))
  candidates = [os.path.join(here, "gin_configs"), os.path.join(os.path.dirname(here), "gin"), os.getcwd()]
  return [p for p in candidates if os.path.isdir(p)]


def register(*classes: type) -> None:
  """Makes config classes bindable by name (`ModelConfig.d_model = 256`), once each.

  gin.register builds a configurable stand-in and returns the class unchanged, so binding a
  setting never changes what a plain `ModelConfig()` is.
  """
  for cls in classes:
    if cls not in _REGISTERED:
      gin.register(cls, module="midas")
      _REGISTERED.append(cls)


register(*configs.CONFIG_CLASSES)


def _resolve_file(path: str) -> str:
  path = fs.check(path, "--gin_file")
  if fs.is_remote(path):
    if not fs.isfile(path):
      raise ConfigError("--gin_file", f"no gin file {path!r}", "pass the URL of an existing gin file")
    return path
  if os.path.isfile(path):
    return path
  for root in gin_search_paths():
    candidate = os.path.join(root, path)
    if os.path.isfile(candidate):
      return candidate
  raise ConfigError("--gin_file", f"no gin file {path!r} (looked in the current directory and in "
                    f"{', '.join(gin_search_paths())})",
                    "pass a path to an existing file, e.g. gin/experiments/cpu_demo.gin")


def _quote_bare_string(binding: str) -> str:
  """Lets `--gin.DataConfig.source=text` mean the string 'text' as a convenience."""
  key, sep, value = binding.partition("=")
  value = value.strip()
  if not sep or not value or value[0] in "@%'\"[({" or value in ("True", "False", "None"):
    return binding
  try:
    ast.literal_eval(value)
    return binding
  except (ValueError, SyntaxError):
    return f"{key}={value!r}"


def _suggest(name: str, choices: Iterable[str]) -> str:
  close = difflib.get_close_matches(name, list(choices), n=3)
  return f"did you mean {', '.join(close)}?" if close else ""


def _explain_gin_error(e: Exception) -> ConfigError:
  msg = str(e).split("\n")[0]
  m = re.search(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'", msg)
  moved = m and configs.MOVED_SETTINGS.get(f"{m.group(1).split('.')[-1]}.{m.group(2)}")
  if moved:
    return ConfigError(f"{m.group(1)}.{m.group(2)}", f"has moved to {moved}",
                       f"bind {moved} instead (gin/objectives/ has the UL2 mixtures as gin files)")
  if m:
    cls = next((c for c in _REGISTERED if c.__name__ == m.group(1).split(".")[-1]), None)
    params = list(inspect.signature(cls).parameters) if cls else []
    hint = _suggest(m.group(2), params)
    return ConfigError(f"{m.group(1)}.{m.group(2)}", "unknown setting",
                       f"{hint + ' ' if hint else ''}valid settings: {', '.join(params)}")
  m = re.search(r"No configurable matching '([\w.]+)'", msg)
  if m:
    names = [c.__name__ for c in _REGISTERED]
    hint = _suggest(m.group(1), names)
    return ConfigError(m.group(1), "unknown configurable",
                       f"{hint + ' ' if hint else ''}configurable classes: {', '.join(names)}")
  return ConfigError("gin", msg, "check the gin file or --gin binding named above")


@contextlib.contextmanager
def _quiet_include_search():
  """gin logs an error for every search path an include is not found in, even when a later one has it."""
  class _DropPathNotFound(logging.Filter):
    def filter(self, record):
      return not str(record.msg).startswith("Path not found")
  root = logging.getLogger()
  quiet = _DropPathNotFound()
  root.addFilter(quiet)
  try:
    yield
  finally:
    root.removeFilter(quiet)


def parse(gin_files: Sequence[str], bindings: Sequence[str]) -> None:
  """Parses gin files (in order) then bindings (which override them)."""
  gin.clear_config()
  for root in gin_search_paths():
    gin.add_config_file_search_path(root)
  try:
    with _quiet_include_search(), contextlib.ExitStack() as stack:
      # gin opens files itself: a gs:// gin file is read from a local copy (its includes resolve
      # against the search paths, not the bucket)
      files = [stack.enter_context(fs.local_copy(_resolve_file(f))) for f in gin_files]
      gin.parse_config_files_and_bindings(files, [_quote_bare_string(b) for b in bindings])
  except ConfigError:
    raise
  except (ValueError, SyntaxError, IOError) as e:
    raise _explain_gin_error(e) from None


def _unwrap_config_error(e: Exception) -> None:
  """gin re-raises errors from inside a configurable with extra context; surface ours unchanged."""
  cause = e
  while cause is not None:
    if isinstance(cause, ConfigError):
      raise ConfigError(cause.setting, cause.problem, cause.fix) from None
    cause = cause.__cause__ or cause.__context__


def build(cls: Type[T]) -> T:
  """A registered config class with the parsed bindings applied; a bad value's error names the setting."""
  try:
    return gin.get_configurable(cls)()
  except Exception as e:  # pylint: disable=broad-except  # gin wraps whatever the constructor raised
    _unwrap_config_error(e)
    raise


def run_config_from_gin() -> configs.RunConfig:
  """The RunConfig of the parsed bindings. Settings that need the stacking operators (the depth a
  schedule reaches, stage lengths against warmups) are checked where a run starts: stacking/checks.py."""
  return configs.RunConfig(**{f.name: build(f.default_factory) for f in dataclasses.fields(configs.RunConfig)})


def operative_config() -> str:
  return gin.operative_config_str()
