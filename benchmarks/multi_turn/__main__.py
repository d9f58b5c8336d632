"""``python -m benchmarks.multi_turn``: the command (also what its worker processes run)."""

import sys

from benchmarks.multi_turn.cli import main

sys.exit(main())
