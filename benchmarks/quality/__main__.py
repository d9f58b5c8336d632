"""``python -m benchmarks.quality``: the command (also what its worker processes run)."""

import sys

from benchmarks.quality.cli import main

sys.exit(main())
