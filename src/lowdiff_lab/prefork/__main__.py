"""``python -m lowdiff_lab.prefork FD [MODULE ...]``: the fork server (see :mod:`lowdiff_lab.prefork`)."""

import sys

from lowdiff_lab.prefork.server import main

sys.exit(main())
