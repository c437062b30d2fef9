import sys

from backport.cli import main

sys.exit(main())
