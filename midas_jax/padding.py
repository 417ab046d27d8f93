"""The arithmetic of padded sizes: a length rounded up to the tile or bucket it is padded to."""


def round_up(n: int, multiple: int) -> int:
  """The smallest multiple of `multiple` that is at least n."""
  return -(-n // multiple) * multiple
