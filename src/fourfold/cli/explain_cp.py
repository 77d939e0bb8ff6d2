"""``fourfold explain ring-attention --cp N``: ring attention drawn from a real run of it.

    fourfold explain ring-attention --cp 4                       # head-tail cut, T = 16
    fourfold explain ring-attention --cp 4 --cp-balance none     # contiguous chunks: watch the last rank work

N ranks are started through torchrun's launcher and run fourfold's ring attention
(:mod:`fourfold.parallel.context.attention`) forward and backward on one tiny sequence, every message recorded
as it is sent (which rank's K/V block, from whom, to whom). Printed and drawn: which block each rank holds at
each step, and how many of that block's (query, key) pairs the causal mask lets it compute; each rank's total
work under the cut asked for beside the other cut; the bytes each rank sent against the theory; and the
output's and gradients' largest difference from one process's attention.

Writes a PNG (``--out``, default ``runs/explain-ring-attention-N.png``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _worker(T: int, balanced: bool) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fourfold import launch
    from fourfold.comm.p2p import Communicator
    from fourfold.parallel.context import ContextShard, attend, theory

    with launch.init("cpu", timeout_s=60) as ctx:
        n, r = ctx.world_size, ctx.rank
        comm = Communicator(None, 60, record_messages=True)
        shard = ContextShard(comm, "ring", T, balanced)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, T, 4, dtype=torch.float64, generator=g, requires_grad=True) for _ in "qkv")
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        want.backward(torch.ones_like(want))
        mine = shard.mine
        ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        y = attend(shard, ql, kl, vl)
        y.backward(torch.ones_like(y))
        grads = [(a.grad, b.grad) for a, b in ((ql, q), (kl, k), (vl, v))]
        error = max(float((y - want[:, :, mine]).detach().abs().max()),
                    *(float((a - b[:, :, mine]).abs().max()) for a, b in grads if a is not None and b is not None))
        work: dict[bool, list[int]] = {}
        for cut in (True, False):  # (query, key) pairs rank r computes with each rank's block, under each cut
            other = ContextShard(comm, "ring", T, cut)
            other_mine = other.everyone[r]
            work[cut] = [int((other.everyone[j][None, :] <= other_mine[:, None]).sum()) for j in range(n)]
        th = theory("ring", n, q_bytes=ql.numel() * 8, kv_bytes=2 * kl.numel() * 8)
        mine_out = {"rank": r, "error": error, "sent": comm.stats.sent_bytes,
                    "theory": th["forward"] + th["backward"], "work": work,
                    "messages": [(m.phase, m.step, m.src, m.dst, m.label) for m in comm.messages]}
        gathered: list[Any] = [None] * n if r == 0 else []
        dist.gather_object(mine_out, gathered if r == 0 else None, dst=0)
        if r == 0:
            _report(n, T, balanced, gathered)
    return 0


def _held(n: int, everyone: list[dict[str, Any]]) -> list[list[int]]:
    """held[r][s]: whose K/V block rank r attends to at forward step s, read from the messages it received."""
    held = [[r] + [-1] * (n - 1) for r in range(n)]
    for got in everyone:
        for phase, step, _src, dst, label in got["messages"]:
            if phase == "forward K/V":
                held[dst][step + 1] = int(label.rsplit(" ", 1)[1])
    return held


def _report(n: int, T: int, balanced: bool, everyone: list[dict[str, Any]]) -> None:
    from fourfold.parallel.context import pieces

    held = _held(n, everyone)
    cut = "head-tail" if balanced else "contiguous"
    lines = [f"ring attention, cp={n}, T={T}, {cut} cut (one sequence, one head, float64)", ""]
    for got in everyone:
        runs = pieces(T, n, got["rank"], balanced)
        lines.append(f"  rank {got['rank']} holds positions {', '.join(f'{a}-{b - 1}' for a, b in runs)}")
    lines += ["", "  step " + "".join(f"{'rank ' + str(r):>18}" for r in range(n))]
    for s in range(n):
        cells = []
        for r in range(n):
            j = held[r][s]
            pairs = everyone[r]["work"][balanced][j]
            cells.append(f"{'K/V ' + str(j)} ({pairs:>3} pairs)")
        lines.append(f"  {s:>4} " + "".join(f"{c:>18}" for c in cells))
    for label, which in ((cut, balanced), ("head-tail" if not balanced else "contiguous", not balanced)):
        totals = [sum(got["work"][which]) for got in everyone]
        lines.append(f"  {label:>10} cut: (query, key) pairs per rank {totals} (max / mean "
                     f"{max(totals) / (sum(totals) / n):.2f})")
    lines.append(f"  each rank sent {[got['sent'] for got in everyone]} bytes; theory {everyone[0]['theory']} "
                 f"(forward (N-1) K/V blocks; backward (N-1) K/V blocks and N dK/dV accumulators)")
    worst = max(got["error"] for got in everyone)
    lines.append(f"  largest difference from one process's attention (output, dq, dk, dv): {worst:.1e}")
    print("\n".join(lines), flush=True)
    path = Path(os.environ.get("FOURFOLD_EXPLAIN_OUT") or f"runs/explain-ring-attention-{n}.png")
    try:
        _draw(n, T, balanced, everyone, held, path)
        print(f"  picture: {path}", flush=True)
    except ImportError:
        print("  picture skipped: matplotlib is not installed (pip install 'fourfold[viz]')", flush=True)


def _draw(n: int, T: int, balanced: bool, everyone: list[dict[str, Any]], held: list[list[int]], path: Path) -> None:
    from matplotlib.figure import Figure

    from fourfold.bench.harness import save_png

    fig = Figure(figsize=(4 + 1.6 * n, 3.6))
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colors = [f"C{j}" for j in range(n)]
    for s in range(n):
        for r in range(n):
            j = held[r][s]
            pairs = everyone[r]["work"][balanced][j]
            ax.add_patch(_box(s, r, colors[j], 0.25 + 0.75 * pairs / max(1, (T // n) ** 2)))
            ax.text(s + 0.5, r + 0.5, f"K/V {j}\n{pairs} pairs", ha="center", va="center", fontsize=7)
    ax.set(xlim=(0, n), ylim=(n, 0), xticks=[s + 0.5 for s in range(n)], xticklabels=[str(s) for s in range(n)],
           yticks=[r + 0.5 for r in range(n)], yticklabels=[f"rank {r}" for r in range(n)], xlabel="ring step")
    ax.set_title(f"whose K/V each rank attends to (cp={n}, T={T})", fontsize=9)
    width = 0.38
    for i, (label, which) in enumerate((("head-tail", True), ("contiguous", False))):
        totals = [sum(got["work"][which]) for got in everyone]
        bx.bar([r + (i - 0.5) * width for r in range(n)], totals, width, label=label,
               color="C0" if which else "0.6")
    bx.set(xticks=range(n), xticklabels=[f"rank {r}" for r in range(n)], ylabel="(query, key) pairs computed")
    bx.set_title("causal work per rank: balanced against not", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path)


def _box(x: float, y: float, color: str, alpha: float) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.04, y + 0.04), 0.92, 0.92, color=color, alpha=alpha, lw=0)


def main(argv: list[str] | None = None) -> int:
    from fourfold.run.args import make_parser
    from fourfold.torchrun import LaunchConfig, is_worker, launch_workers

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_parser("fourfold explain ring-attention", __doc__)
    parser.add_argument("--cp", type=int, default=4, help="context-parallel ranks (2..8, default 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens (default 4 x cp; a multiple of 2 x cp)")
    parser.add_argument("--cp-balance", choices=("head-tail", "none"), default="head-tail",
                        help="the cut: head-tail (default) or none (contiguous chunks)")
    parser.add_argument("--out", default=None, help="PNG path (default runs/explain-ring-attention-N.png)")
    args = parser.parse_args(argv)
    T = args.seq_len or 4 * args.cp
    if is_worker():
        return _worker(T, args.cp_balance == "head-tail")
    if not 2 <= args.cp <= 8:
        parser.error(f"--cp must be in 2..8, got {args.cp}.")
    if T % (2 * args.cp):
        parser.error(f"--seq-len must be a multiple of 2 x cp = {2 * args.cp}, got {T}.")
    if args.out:
        os.environ["FOURFOLD_EXPLAIN_OUT"] = args.out
    worker = ["--cp", str(args.cp), "--seq-len", str(T), "--cp-balance", args.cp_balance]
    return launch_workers("fourfold.cli.explain_cp", worker, LaunchConfig(nproc=args.cp))


if __name__ == "__main__":
    sys.exit(main())
