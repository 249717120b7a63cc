"""`python -m mxforge.cli`: the `mxforge` command."""

import sys

from mxforge.cli.main import main

sys.exit(main())
