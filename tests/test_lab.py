"""``fourfold lab``: an emulated cluster of network namespaces with tbf-shaped links (needs root, iproute2, tbf).

Skipped, with the one-line reason, where the machine cannot make a lab. Each test leaves no namespace, veth or
qdisc behind (checked after every test, and a crashed lab's leftovers are removed by the next start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fourfold.lab import tcp
from fourfold.lab.net import PREFIX, Lab, default_tcp, leftovers, parse_rate, unavailable

WHY = unavailable()
needs_lab = pytest.mark.skipif(WHY is not None, reason=WHY or "")
pytestmark = pytest.mark.lab


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    if WHY is None:
        assert leftovers() == [], "a lab namespace was left behind"
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert "ffl-" not in links, "a lab veth was left in the machine's own namespace"


def test_link_rates_parse_and_bad_ones_are_refused():
    assert parse_rate("1gbit") == 10**9 and parse_rate("100mbit") == 10**8 and parse_rate("10MBps") == 8 * 10**7
    assert parse_rate("1Gbps") == 8 * 10**9  # tc's units: bps is bytes per second, kept on purpose
    for bad in ("fast", "1gb", "0mbit", "1000gbit"):
        with pytest.raises(ValueError, match="link must be"):
            parse_rate(bad)
    with pytest.raises(ValueError, match="gbit are bits per second; kbps, mbps, gbps bytes per second"):
        parse_rate("1gb")  # the error says which is which
    from fourfold.lab.net import rate_words

    assert rate_words("1Gbps", parse_rate("1Gbps")) == "1Gbps (8 Gbit/s: tc's bps is bytes per second)"
    assert rate_words("1gbit", parse_rate("1gbit")) == "1gbit"  # what the lab and plan print beside the rate
    with pytest.raises(ValueError, match="nodes must be between 1 and 64"):
        Lab(0)


def test_a_congestion_control_a_namespace_may_not_choose_is_said_or_refused(monkeypatch, tmp_path):
    """A kernel whose tcp_allowed_congestion_control leaves cubic out refuses it inside a namespace (with a write
    error only at close): the default then keeps the machine's and says why; an explicit one is refused. (This
    VM's kernel 6.18: bbr by default, 'reno bbr' allowed; here read from files of the test's own.)"""
    lists = {"available": ["reno", "bbr", "cubic"], "allowed": ["reno", "bbr"]}
    monkeypatch.setattr(tcp, "congestion_controls", lambda which="available": lists[which])
    (tmp_path / "tcp_congestion_control").write_text("bbr\n")
    monkeypatch.setattr(tcp, "CONGESTION_FILE", str(tmp_path / "tcp_congestion_control"))
    lab = Lab(2)
    assert lab.tcp == "bbr" and "cubic cannot be chosen inside a network namespace on this kernel" in lab.note
    assert "sysctl -w net.ipv4.tcp_allowed_congestion_control='reno bbr cubic'" in lab.note
    with pytest.raises(ValueError, match=r"tcp must be one a network namespace may choose on this kernel .* got "
                                         r"'cubic'. Pass --tcp bbr"):
        Lab(2, tcp="cubic")
    assert Lab(2, tcp="bbr").note is None and Lab(2, tcp="keep").tcp == "keep"
    lists["allowed"] = ["reno", "cubic"]
    assert (Lab(2).tcp, Lab(2).note) == ("cubic", None)


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fourfold.cli", "lab", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``fourfold lab ARGS`` in this process (a refusal starts nothing: no interpreter of its own needed)."""
    from fourfold.cli import main

    try:
        code = main(["lab", *args])
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["fourfold", "lab", *args], code, out, err)


def test_bad_lab_flags_are_refused_before_any_namespace_exists(capsys):
    proc = _refused(capsys, "run", "--nodes", "2", "--link", "fast", "--", "fourfold", "train")
    assert proc.returncode == 2 and "link must be a rate such as 100mbit" in proc.stderr
    proc = _refused(capsys, "run", "--nodes", "2")
    assert proc.returncode == 2 and "needs a command after --" in proc.stderr
    proc = _refused(capsys, "run", "--nodes", "2", "--tcp", "vegas-ng", "--", "true")
    assert proc.returncode == 2 and "tcp must be one of this kernel's congestion controls" in proc.stderr


@needs_lab
@pytest.mark.timeout(60)
def test_lab_shapes_each_link_and_removes_a_crashed_labs_leftovers():
    subprocess.run(["ip", "netns", "add", PREFIX + "n9"], check=True)  # what a killed lab would leave
    with Lab(2, "50mbit") as lab:
        assert leftovers() == [PREFIX + "n0", PREFIX + "n1", PREFIX + "sw"]  # n9 is gone
        assert "tbf" in lab.qdiscs(0) and "rate 50Mbit" in lab.qdiscs(0)
        # cubic where the kernel lets a namespace choose it, else the machine's default, said; set, not assumed
        assert lab.tcp_settings(0) == lab.tcp_settings(1) == (default_tcp()[0], 0)
        server = subprocess.Popen(lab.exec_argv(0, [sys.executable, "-c", (
            "import socket\ns = socket.socket(); s.bind(('10.213.0.1', 5000)); s.listen(); c, _ = s.accept()\n"
            "n = 0\nwhile (b := c.recv(1 << 20)):\n    n += len(b)\nprint(n)")]), stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)
        start = time.monotonic()
        subprocess.run(lab.exec_argv(1, [sys.executable, "-c", (
            "import socket, time\nfor _ in range(50):\n    try:\n        s = socket.create_connection(('10.213.0.1', "
            "5000)); break\n    except OSError: time.sleep(0.1)\ns.sendall(b'x' * (4 << 20)); s.close()")]),
            check=True, timeout=30)
        received = int(server.communicate(timeout=30)[0])
        elapsed = time.monotonic() - start
    assert received == 4 << 20
    # 4 MiB at 50 Mbit/s takes at least 0.67 s on the wire: the link is shaped (a lower bound, not a speed test)
    assert elapsed >= 0.9 * (4 << 20) * 8 / 50e6, f"4 MiB crossed a 50 Mbit/s link in {elapsed:.2f} s"


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@needs_lab
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_across_two_lab_nodes_equals_one_process(tmp_path):
    common = ["--steps", "2", "--dtype", "float64", "--no-memory-check", "--no-trace", "--no-progress"]
    proc = _cli("run", "--nodes", "2", "--gpus-per-node", "1", "--link", "1gbit", "--", "fourfold", "train",
                *common, "--allreduce", "ring", "--out", str(tmp_path / "lab"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 node(s) x 1 rank(s)" in proc.stderr and "dp=2" in proc.stdout
    one = subprocess.run([sys.executable, "-m", "fourfold.cli", "train", *common, "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    for a, b in zip(_losses(tmp_path / "lab"), _losses(tmp_path / "one"), strict=True):
        assert abs(a - b) <= 1e-10, (_losses(tmp_path / "lab"), _losses(tmp_path / "one"))


@needs_lab
def test_check_and_down_say_what_they_did():
    assert _cli("check").stdout.startswith("fourfold lab: this machine can make a lab")
    subprocess.run(["ip", "netns", "add", PREFIX + "n3"], check=True)
    proc = _cli("down")
    assert proc.returncode == 0 and f"removed {PREFIX}n3" in proc.stdout


@needs_lab
@pytest.mark.timeout(60)
def test_a_running_lab_is_neither_remade_nor_removed_by_another_process():
    from fourfold.lab.net import LabBusy

    with Lab(1):
        up = leftovers()
        with pytest.raises(LabBusy, match=f"a lab is up, made by pid {os.getpid()}"):
            Lab(1).up()
        proc = _cli("down")  # another process: it would have cut this lab's ranks off mid-step
        assert proc.returncode == 2 and f"a lab is up, made by pid {os.getpid()}" in proc.stderr, proc.stderr
        assert leftovers() == up
    proc = _cli("down")  # released with the lab: nothing left to remove, and nothing refused
    assert proc.returncode == 0 and "no lab to remove" in proc.stdout, proc.stdout + proc.stderr


def test_bad_sweep_flags_are_refused_before_any_namespace_exists(capsys):
    proc = _refused(capsys, "sweep", "--nodes", "2,four")
    assert proc.returncode == 2 and "nodes must be comma-separated counts" in proc.stderr
    proc = _refused(capsys, "sweep", "--nodes", "1", "--gpus-per-node", "1")
    assert proc.returncode == 2 and "at least 2 ranks in each lab" in proc.stderr
    proc = _refused(capsys, "sweep", "--size", "3B")
    assert proc.returncode == 2 and "size must be a positive multiple of 4 bytes" in proc.stderr


@needs_lab
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sweep_fits_both_links_and_predicts_every_algorithm(tmp_path):
    from fourfold.comm.network import link_bytes, messages

    proc = _cli("sweep", "--nodes", "2", "--gpus-per-node", "2", "--link", "1gbit", "--size", "64KB",
                "--algorithms", "ring,hierarchical,master", "--iters", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "node link: alpha" in proc.stdout and "network link: alpha" in proc.stdout
    bench = json.loads((tmp_path / "nodes2" / "bench.json").read_text())
    assert bench["cost_model"]["network"] is not None  # the link between nodes, fitted apart from loopback
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    rows = {r["algorithm"]: r for r in sweep["rows"]}
    assert set(rows) == {"ring", "hierarchical", "master"} and all(r["ranks"] == 4 for r in rows.values())
    for name, r in rows.items():
        assert r["predicted_s"] > 0 and r["median_s"] > 0
        _, links = link_bytes(messages(name, (64 << 10) // 4, 4, 4, 2), 2)
        assert r["busiest_link_bytes"] == max(max(v) for v in links.values())
    assert rows["hierarchical"]["busiest_link_bytes"] < rows["ring"]["busiest_link_bytes"]
    assert any("within 20% of its model" in t["target"] for t in sweep["targets"])
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_a_lab_keeps_its_cost_model_apart_from_this_machines(monkeypatch):
    from fourfold.lab.run import _node_env

    monkeypatch.delenv("FOURFOLD_COST_MODEL", raising=False)
    env = _node_env(Lab(4, "250mbit"), 1, 2)
    tcp = default_tcp()[0]  # the congestion control the lab uses: cubic, where a namespace may choose it
    assert env["FOURFOLD_COST_MODEL"].endswith(f"/.cache/fourfold/lab/cost_model-4x2-250mbit-{tcp}.json")
    monkeypatch.setenv("FOURFOLD_COST_MODEL", "/tmp/mine.json")  # the user's choice wins
    assert _node_env(Lab(4, "250mbit"), 1, 2)["FOURFOLD_COST_MODEL"] == "/tmp/mine.json"


def test_a_lab_lock_that_cannot_be_opened_is_one_line_not_a_traceback(monkeypatch, tmp_path, capsys):
    from fourfold.cli.lab import main
    from fourfold.lab import net

    monkeypatch.setattr(net, "LOCK", tmp_path / "missing" / "fourfold-lab.lock")  # as /run is, to a non-root user
    monkeypatch.setattr(net, "leftovers", lambda: [])
    assert main(["down"]) == 2
    assert "cannot open the lab's lock" in capsys.readouterr().err
