"""`python -m ripples.cli ...`: the `ripples` command (how launchers start workers)."""

import sys

from ripples.cli.main import main

sys.exit(main())
