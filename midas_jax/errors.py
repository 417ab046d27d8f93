"""The errors the CLI prints without a traceback: bad user input (ConfigError), a loss that is not finite,
and faults that stop a run from outside its config (FaultError: storage that does not answer, a host out of memory)."""


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


class FaultError(RuntimeError):
  """The run stopped on a fault outside its config and code (storage that does not answer, a host out of
  memory). The message says what failed, where, and what to do; the CLI prints it without a traceback and
  exits with `exit_status`."""

  exit_status = 1


class HaltedError(FaultError):
  """A failure that running the same command again would repeat (the same step failed on the attempt
  before): exit status 3, which no supervisor restarts (midas_jax/exit_status.py)."""

  exit_status = 3


class RestartNeededError(FaultError):
  """The run stopped in a state from which starting it again goes on (a damaged save set aside while the
  other processes were not answering): exit status 76, which supervisors restart at once."""

  exit_status = 76


class StorageUnavailableError(FaultError):
  """The storage did not answer (HTTP 408/429/5xx, a connection reset or timed out, credentials refused)
  after the retries. Nothing stored was judged by it, so the same command run later goes on where this one
  stopped; exit status 75 (EX_TEMPFAIL, "try again later") tells a supervisor so, apart from bad input (2)."""

  exit_status = 75
