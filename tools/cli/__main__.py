"""`python -m tools.cli`: how `tpla serve` and the tests start a sub-command in a child."""

import sys

from tools.cli.main import main

sys.exit(main())
