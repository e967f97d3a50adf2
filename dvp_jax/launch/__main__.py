"""`python -m dvp_jax.launch ACTION ...` (see `dvp_jax/launch/cli.py`)."""

import sys

from dvp_jax.launch.cli import main

sys.exit(main())
