"""The exceptions an error is made of, and the status code it carries, for the modules that tell a storage
outage from a damaged save from a host out of memory (fs/storage_errors.py, checkpoint/damage.py).

Libraries wrap the error that tells (orbax raises `Exception(...) from` tensorstore's, a thread pool gathers
several into an ExceptionGroup), so a verdict reads every link: causes, contexts and group members, each
once, at most LIMIT of them. Both modules walk the same links, so a verdict never depends on which of them
looked.

The status code is the absl StatusCode name (DATA_LOSS, UNAVAILABLE, ...): stable API, unlike the words
around it. jax's runtime errors carry it as an attribute (`error_code_string`); tensorstore raises builtin
ValueError (IndexError, NotImplementedError) whose message is absl's `Status::ToString()`, so the name
before the first ": " is its code, and only that is read. tensorstore drops the prefix for
INVALID_ARGUMENT and UNIMPLEMENTED (the exception type implies them), so those read as no code.
"""

from __future__ import annotations

from typing import List, Optional

LIMIT = 32  # links read at most: a group of many shard reads is judged by its first ones
ABSL_CODES = frozenset((  # absl::StatusCode names, as StatusCodeToString spells them
    "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
    "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"))


def links(error: Optional[BaseException], limit: int = LIMIT) -> List[BaseException]:
  """`error`, then (breadth first) its cause, its context and the members of an exception group, each once."""
  seen, out, todo = set(), [], [error]
  while todo and len(out) < limit:
    e = todo.pop(0)
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    out.append(e)
    todo.extend([e.__cause__, e.__context__, *_members(e)])
  return out


def _members(e: BaseException) -> tuple:
  members = getattr(e, "exceptions", ()) if isinstance(e, BaseExceptionGroup) else ()
  return tuple(members)


def status_code(e: BaseException) -> Optional[str]:
  """The absl status code `e` carries (jax's attribute, or the prefix of tensorstore's message), or None."""
  code = getattr(e, "error_code_string", None)  # jax >= 0.10: JaxRuntimeError.error_code_string
  if isinstance(code, str) and code in ABSL_CODES:
    return code
  head = str(e).split(": ", 1)
  return head[0] if len(head) == 2 and head[0] in ABSL_CODES else None
