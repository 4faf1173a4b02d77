"""`python -m gpulayer ...`: the same command line as `gpulayer ...`."""

import sys

from .cli import main

sys.exit(main())
