"""`python -m pagemesh.loadgen`: `pagemesh bench` without the `pagemesh` command."""

import sys

from pagemesh.loadgen.cli import main

sys.exit(main())
