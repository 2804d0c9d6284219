"""`python -m pagemesh.tools.loadgen`: `pagemesh bench` without the `pagemesh` command."""

import sys

from pagemesh.tools.loadgen.cli import main

sys.exit(main())
