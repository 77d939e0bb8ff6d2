"""What every test runs under.

``FOURFOLD_RANK_START=fork``: the suite vouches that its own modules (the test files, the models they write)
read no rank at import, so a launch from a test's process, or of a test's model, forks its ranks (0.4 s from a
warm process) rather than starting interpreters (8 s); see :func:`fourfold.torchrun.rank_start`. The tests of
that rule set the variable themselves.
"""

from __future__ import annotations

import os

os.environ.setdefault("FOURFOLD_RANK_START", "fork")
