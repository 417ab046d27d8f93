"""`python -m midas_jax` is the `midas` command."""

import sys

from midas_jax.cli import main

sys.exit(main())
