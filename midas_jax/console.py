"""What a run prints to the terminal: whole lines, kept apart from the progress bar."""

from __future__ import annotations

import sys
from typing import Optional

import tqdm


def say(line: str) -> None:
  """Prints one whole line to stdout, above the progress bar if one is drawn.

  Every line a run prints goes through here: tqdm clears its bar, the line is written, and the bar
  is drawn again below it, so a terminal never shows a log line glued to a bar.
  """
  tqdm.tqdm.write(line, file=sys.stdout)
  sys.stdout.flush()


def is_tty(stream) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, ValueError):
    return False


def bar_wanted(setting: Optional[bool]) -> bool:
  """TrainerConfig.progress_bar: None draws the bar only when stderr is a terminal."""
  return is_tty(sys.stderr) if setting is None else bool(setting)
