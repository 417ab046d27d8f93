"""One error type for bad user input, so the CLI can print it without a traceback."""


class ConfigError(ValueError):
  """Bad input from a user: a config value, a flag, a data file, a workdir.

  The message always names the setting and says how to fix it.
  """

  def __init__(self, setting: str, problem: str, fix: str):
    self.setting = setting
    self.problem = problem
    self.fix = fix
    super().__init__(f"{setting}: {problem}\n  fix: {fix}")


def require(condition: bool, setting: str, problem: str, fix: str) -> None:
  if not condition:
    raise ConfigError(setting, problem, fix)


class NonFiniteLossError(RuntimeError):
  """The loss became NaN or inf; the state of that step is never handed to the checkpointer."""
