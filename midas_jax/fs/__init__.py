"""The path layer: local paths and gs:// URLs through one set of functions (fs/paths.py)."""

from midas_jax.fs.paths import (SCHEMES, absolute, as_epath, check, copy, exists, glob, is_remote, isdir,
                                isfile, join, listdir, local_copy, makedirs, matches, open_file, read_bytes,
                                read_json, read_text, remove, rename, rmtree, scheme, size, staged_dir,
                                write_bytes, write_json, write_text)

__all__ = ["SCHEMES", "absolute", "as_epath", "check", "copy", "exists", "glob", "is_remote", "isdir", "isfile",
           "join", "listdir", "local_copy", "makedirs", "matches", "open_file", "read_bytes", "read_json",
           "read_text", "remove", "rename", "rmtree", "scheme", "size", "staged_dir", "write_bytes",
           "write_json", "write_text"]
