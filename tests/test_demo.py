"""``fourfold demo`` (what ``make demo`` runs) end to end, with a few steps per run instead of hundreds.

Reading a failure: the demo is the first thing a new user runs; a run that fails, a table row that is missing
or a loss gap beyond float32 rounding is what they would see.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _gap(text: str, row: str) -> float:
    """The last column (``max |loss - reference|``) of the table row that starts with ``row``."""
    line = next(line for line in text.splitlines() if line.strip().startswith(row))
    return float(line.split()[-1])


@pytest.mark.timeout(300)
def test_the_demo_runs_through_and_every_layout_matches_one_process(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "fourfold", "demo", "--steps", "2",
                           "--dp-steps", "2", "--pack-steps", "1", "--out", str(out)],  # the fewest: no warm-up step to leave out
                          capture_output=True, text=True, timeout=280)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    for part in range(1, 6):
        assert f"fourfold demo {part}/5" in text, text[-4000:]
    # float32 on 2 ranks: the same losses as one process up to rounding
    for row in ("dp=2, native all-reduce", "dp=2, ring all-reduce", "tp=2 (matmuls split)"):
        assert _gap(text, row) < 1e-3, row
    native = next(line for line in text.splitlines() if "dp=2, native all-reduce" in line)
    assert "not counted" in native, native  # the backend's bytes: unknown, not 0
    assert _gap(text, "packed, best-fit decreasing") < 1e-4
    for picture in ("timeline-single.png", "timeline-dp.png", "timeline-pp-1f1b.png", "packing.png",
                    "memory.png"):
        assert (out / picture).stat().st_size > 5_000, picture


def test_demo_steps_below_one_are_a_usage_error(capsys):
    from fourfold.cli.demo import main

    with pytest.raises(SystemExit) as e:
        main(["--dp-steps", "0"])
    assert e.value.code == 2 and "--dp-steps must be >= 1, got 0" in capsys.readouterr().err
