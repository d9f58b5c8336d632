"""``python -m benchmarks.results_doc [--check]``."""

import sys

from benchmarks.results_doc.document import main

sys.exit(main())
