"""`python -m benchmarks.real {family,scale} COMMAND ...` (see `benchmarks/README.md`)."""

import sys

from .cli import main

sys.exit(main())
