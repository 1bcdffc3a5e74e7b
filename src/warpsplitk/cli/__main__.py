"""``python -m warpsplitk.cli``: the ``warpsplitk`` command."""

import sys

from . import main

sys.exit(main())
