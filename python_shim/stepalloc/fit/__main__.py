"""``python -m stepalloc.fit --help``: see ``_cli.py``."""

import sys

from ._cli import main

sys.exit(main())
