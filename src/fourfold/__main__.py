"""``python -m fourfold`` is the ``fourfold`` command."""

import sys

from fourfold.cli import main

sys.exit(main())
