"""`python -m attnlens`: the command line (attnlens/cli.py)."""

import sys

from .cli import main

sys.exit(main())
