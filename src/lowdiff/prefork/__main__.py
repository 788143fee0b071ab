"""``python -m lowdiff.prefork FD [MODULE ...]``: the fork server (see :mod:`lowdiff.prefork`)."""

import sys

from lowdiff.prefork.server import main

sys.exit(main())
