"""``examples/train_loop.py``: a training loop of the user's own on the engine, run as its docstring says (one
process, and torchrun with fourfold's loopback rendezvous), prints the same losses under a pipeline as on one
process. The model is ``examples/my_model.py``, with its own plan and split."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)", output, re.MULTILINE)] + [
        float(x) for x in re.findall(r"^held-out loss (\S+)", output, re.MULTILINE)]


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=EXAMPLES, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_your_loop_under_a_pipeline_prints_one_processs_losses(tmp_path):
    one = _losses(_run([sys.executable, "train_loop.py", "--steps", "3", "--save", str(tmp_path / "one.pt")]))
    two = _losses(_run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend",
                        "fourfold-loopback", "--rdzv-endpoint", "127.0.0.1:0", "train_loop.py", "--pp", "2",
                        "--steps", "3"]))
    assert len(one) == len(two) == 4, (one, two)  # three steps and the held-out loss
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) < 1e-5, (one, two)  # float32 rounding
    assert (tmp_path / "one.pt").stat().st_size > 0
