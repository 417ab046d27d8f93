"""The path layer: local paths and gs:// URLs through one set of functions (fs/paths.py)."""

from midas_jax.fs.paths import (SCHEMES, absolute, append_text, as_epath, basename, check, copy, dirname, exists,
                                glob, is_remote, isdir, isfile, join, listdir, local_copy, local_tree, make_output_dir,
                                makedirs, matches, open_file, read_bytes, read_json, read_text, relative, remove,
                                rename, rmtree, scheme, size, staged_dir, tree_size, write_bytes, write_figure,
                                write_json, write_text)
from midas_jax.fs.appender import Appender, appended_exists, read_appended
from midas_jax.fs.mirror import Mirror

__all__ = ["SCHEMES", "Appender", "Mirror", "absolute", "append_text", "appended_exists", "as_epath", "basename",
           "check", "copy", "dirname", "exists", "glob", "is_remote", "isdir", "isfile", "join", "listdir",
           "local_copy", "local_tree", "make_output_dir", "makedirs", "matches", "open_file", "read_appended",
           "read_bytes", "read_json", "read_text", "relative", "remove", "rename", "rmtree", "scheme", "size",
           "staged_dir", "tree_size", "write_bytes", "write_figure", "write_json", "write_text"]
