"""``python -m warpsplitk``: the ``warpsplitk`` command (:mod:`warpsplitk.cli`)."""

import sys

from .cli import main

sys.exit(main())
