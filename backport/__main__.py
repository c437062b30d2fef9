"""`python -m backport`: the `sglang-backport` command (also where `-X importtime` is measured)."""

import sys

from backport.cli import main

sys.exit(main())
