"""`python -m bench.loadgen`: `pagemesh bench` without the `pagemesh` command."""

import sys

from bench.loadgen.cli import main

sys.exit(main())
