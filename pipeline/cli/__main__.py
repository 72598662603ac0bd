"""`python -m pipeline.cli`: the `osd` command."""

import sys

from pipeline.cli import main

sys.exit(main())
