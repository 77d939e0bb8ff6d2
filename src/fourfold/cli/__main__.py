"""``python -m fourfold.cli``: the same as the ``fourfold`` command."""

import sys

from fourfold.cli import main

sys.exit(main())
