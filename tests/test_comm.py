"""fourfold.comm.allreduce: every algorithm in ``ALGORITHMS`` summed, counted, refused and timed out on real ranks.

Processes are the expensive part, so one ``run_ranks`` spawn per world size runs every algorithm x length x
dtype, and three tests read it (``sweep`` fixture): exact sums, bitwise agreement between ranks, and bytes /
messages against the cost formulas. The algorithm list is read at run time, so an algorithm added to
``ALGORITHMS`` is covered here without editing this file (its cost is checked when its module has ``theory``).

Reading a failure: each line names ``<algorithm> G=<world size> n=<length> <dtype> rank <r>`` and what was
wrong (max error and the first wrong element, differing digests, or measured vs expected bytes/messages). A
``RankError`` instead means an algorithm raised or hung inside a rank: its message starts with the same label.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from fourfold import Mesh
from fourfold.comm import ALGORITHMS, CommError, Communicator, allreduce, ring
from fourfold.comm.wait import gather_objects
from fourfold.observe.trace import Tracer
from fourfold.parallel.tensor.comm import all_reduce as tp_all_reduce
from fourfold.testing import run_ranks

WORLD_SIZES = (1, 2, 3, 4, 5)
MAX_G = 8  # the exact-sum inputs below are scaled so that up to MAX_G of them sum without overflow or rounding
EXACT = (torch.int32, torch.int64, torch.float64)
INEXACT = (torch.float32, torch.float16, torch.bfloat16)
DTYPES = EXACT + INEXACT


def _lengths(world_size: int) -> list[int]:
    # 0 and 1 (empty and single), 7 and G-1 (fewer elements than ranks: empty ring segments), 17^3 (prime
    # power: never divisible by G), 2^20+3 (large, uneven, and past any small-message path)
    return sorted({0, 1, 7, world_size - 1, 17**3, 2**20 + 3})


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _label(alg: str, world_size: int, n: int, dtype: torch.dtype) -> str:
    return f"{alg} G={world_size} n={n} {_name(dtype)}"


# --------------------------------------------------------------------------------------------------- inputs


def _case(n: int, world_size: int, dtype: torch.dtype):
    """``(inputs, want, tol)``: every rank's input, the exact sum, and the float tolerance (None: exact).

    Rank r's input is elements r..r+n-1 of one seeded series, so inputs differ between ranks (even at n=1) and
    every rank can rebuild all of them and the exact sum without drawing G random tensors.
    """
    g = torch.Generator().manual_seed(7_919 * n + DTYPES.index(dtype))
    m = n + world_size - 1
    if dtype == torch.int64:  # ~2^60: a detour through float64 (53-bit mantissa) would change the sum
        series = wide = torch.randint(-(2**63) // MAX_G, 2**63 // MAX_G, (m,), generator=g, dtype=torch.int64)
    elif dtype == torch.int32:  # ~2^28: a detour through float32 would show
        series = torch.randint(-(2**31) // MAX_G, 2**31 // MAX_G, (m,), generator=g, dtype=torch.int32)
        wide = series.long()  # int64 sums: exact
    elif dtype == torch.float64:  # k * 2^-30, |k| < 2^49: 49-bit mantissas, and every sum is exact (< 2^52 units)
        wide = torch.randint(-(2**49), 2**49, (m,), generator=g, dtype=torch.int64)  # the integers k
        series = wide.double() * 2.0**-30
    else:  # U(-1, 1) rounded to dtype; the reference sum in float64 is off by <= ~1e-16, far below the tolerance
        series = (torch.rand(m, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
        wide = series.double()
    inputs = [series[r:r + n] for r in range(world_size)]
    total = sum(wide[r:r + n] for r in range(world_size))
    if dtype == torch.float64:
        return inputs, total.double() * 2.0**-30, None
    if dtype in EXACT:
        return inputs, total.to(dtype), None
    magnitude = wide.abs()
    return inputs, total, _tolerance(dtype, world_size, sum(magnitude[r:r + n] for r in range(world_size)))


def _tolerance(dtype: torch.dtype, world_size: int, abs_sum: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |computed - exact sum| for a float sum of G terms: gamma_{G-1} * sum_r |x_r|.

    Whatever the order or tree (rank order for naive/master, a chain starting at the segment owner's right
    neighbour for ring, gloo's own for native), each element goes through at most G-1 additions, each rounding
    with relative error <= u = eps/2, so |error| <= gamma_{G-1} * sum|x_r| with gamma_k = k*u / (1 - k*u)
    (Higham, Accuracy and Stability of Numerical Algorithms, sec. 4.2). That is why the tolerance grows with G.
    The factor 1.01 covers torch adding float16/bfloat16 in float32 and rounding twice (adds ~2^-13 u).
    """
    k, u = world_size - 1, torch.finfo(dtype).eps / 2
    return 1.01 * (k * u / (1 - k * u)) * abs_sum


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.view(torch.uint8).numpy()).hexdigest()  # hashes the tensor's memory, no copy


def _check_sum(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor | None, label: str) -> str | None:
    """None when ``got`` equals ``want`` (exactly, or within ``tol``); else what is wrong, with the max error."""
    if tol is None:
        if torch.equal(got, want):
            return None
        bad = (got != want).nonzero()
        i = int(bad[0])
        err = (got.double() - want.double()).abs().max().item()
        return (f"{label}: {len(bad)} of {got.numel()} elements differ from the exact sum, max |error| ~ "
                f"{err:.3g}; first at index {i}: got {got[i].item()!r}, want {want[i].item()!r}")
    err = (got.double() - want).abs_()
    if bool((err <= tol).all()):  # written so that NaN fails
        return None
    bad = (~(err <= tol)).nonzero()
    i = int(bad[0])
    return (f"{label}: {len(bad)} of {got.numel()} elements outside tolerance, max |error| {err.max().item():.3g}; "
            f"first at index {i}: got {got[i].item()!r}, want {want[i].item()!r} +- {tol[i].item():.3g}")


# ------------------------------------------------------------------------------------ the sweep, one per G


def _sweep(ctx):
    """Every algorithm x length x dtype on this rank: failures, result digests and counted traffic."""
    rank, world_size = ctx.rank, ctx.world_size
    assert world_size <= MAX_G
    algorithms = list(ALGORITHMS)
    comms = {alg: Communicator(timeout_s=30) for alg in algorithms}  # one each: buffers reused across calls
    failures, digests, costs = [], {}, {}
    for n in _lengths(world_size):
        for dtype in DTYPES:
            inputs, want, tol = _case(n, world_size, dtype)  # once per (n, dtype), shared by every algorithm
            for alg in algorithms:
                label = _label(alg, world_size, n, dtype)
                c = comms[alg]
                c.stats.reset()
                t = inputs[rank].clone()
                try:
                    out = allreduce(t, alg, comm=c)
                except Exception as e:
                    raise RuntimeError(f"{label} rank {rank}: {type(e).__name__}: {e}") from e
                if out is not t:
                    failures.append(f"{label} rank {rank}: returned a new tensor, not the input (in place)")
                problem = _check_sum(t, want, tol, f"{label} rank {rank}")
                if problem:
                    failures.append(problem)
                digests[alg, n, _name(dtype)] = _digest(t)
                s = c.stats
                costs[alg, n, _name(dtype)] = (s.sent_bytes, s.sent_messages, s.recv_bytes, s.recv_messages)
    return {"failures": failures, "digests": digests, "costs": costs}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda g: f"G{g}")
def sweep(request):
    """(world_size, per-rank results of ``_sweep``): one spawn per world size, shared by three tests."""
    world_size = request.param
    return world_size, run_ranks(_sweep, world_size, timeout_s=90)


@pytest.mark.timeout(120)
def test_every_algorithm_sums_exactly_or_within_tolerance(sweep):
    world_size, results = sweep
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} wrong results at G={world_size}:\n" + "\n".join(failures[:40])


@pytest.mark.timeout(120)
def test_every_rank_holds_bitwise_the_same_result(sweep):
    world_size, results = sweep
    wrong = []
    for key in results[0]["digests"]:
        alg, n, dtype = key
        if alg == "native":  # gloo's own reduction promises the sum, not bitwise agreement
            continue
        seen = [r["digests"][key] for r in results]
        if len(set(seen)) > 1:
            wrong.append(f"{alg} G={world_size} n={n} {dtype}: result digests per rank {seen}")
    assert not wrong, "ranks disagree bitwise:\n" + "\n".join(wrong)


# ------------------------------------------------------------------------------------------ cost formulas


def _formula(alg: str, n: int, world_size: int, rank: int) -> tuple[int, int, int, int] | None:
    """(sent elements, sent messages, received elements, received messages) per rank, written out here."""
    g = world_size
    if alg == "naive":  # everyone sends its whole tensor to every other rank
        return (g - 1) * n, g - 1, (g - 1) * n, g - 1
    if alg == "master":  # gather to root 0, sum, send back
        return ((g - 1) * n, g - 1, (g - 1) * n, g - 1) if rank == 0 else (n, 1, n, 1)
    if alg == "ring":  # member i sends every segment but i (reduce-scatter) and but i+1 (all-gather)
        lens = [length for _, length in ring.segments(n, g)]
        return (2 * n - lens[rank] - lens[(rank + 1) % g], 2 * (g - 1),
                2 * n - lens[(rank - 1) % g] - lens[rank], 2 * (g - 1))
    return None


def _theory(alg: str):
    """``fourfold.comm.<alg>.theory(numel, G, rank, itemsize) -> (sent_bytes, messages)``, when there is one."""
    name = f"fourfold.comm.{alg}"
    if importlib.util.find_spec(name) is None:
        return None
    return getattr(importlib.import_module(name), "theory", None)


@pytest.mark.timeout(120)
def test_bytes_and_messages_per_rank_match_the_theory(sweep):
    world_size, results = sweep
    wrong = []
    for (alg, n, dtype), _ in results[0]["costs"].items():
        itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        theory = _theory(alg)
        for rank, r in enumerate(results):
            sent_b, sent_m, recv_b, recv_m = r["costs"][alg, n, dtype]
            label = f"{alg} G={world_size} n={n} {dtype} rank {rank}"
            if n == 0 or world_size == 1:  # allreduce returns before the algorithm runs: nothing on the wire
                if (sent_b, sent_m, recv_b, recv_m) != (0, 0, 0, 0):
                    wrong.append(f"{label}: sent/received {sent_b} B in {sent_m} / {recv_b} B in {recv_m}, want 0")
                continue
            formula = _formula(alg, n, world_size, rank)
            if formula is not None:
                want = (formula[0] * itemsize, formula[1], formula[2] * itemsize, formula[3])
                if (sent_b, sent_m, recv_b, recv_m) != want:
                    wrong.append(f"{label}: (sent B, sent msgs, recv B, recv msgs) = "
                                 f"{(sent_b, sent_m, recv_b, recv_m)}, formula says {want}")
                if theory is not None and tuple(theory(n, world_size, rank, itemsize)) != want[:2]:
                    wrong.append(f"{label}: {alg}.theory() = {tuple(theory(n, world_size, rank, itemsize))}, "
                                 f"formula (sent B, msgs) = {want[:2]}")
            elif theory is not None:
                want2 = tuple(theory(n, world_size, rank, itemsize))
                if (sent_b, sent_m) != want2:
                    wrong.append(f"{label}: sent {sent_b} B in {sent_m} messages, {alg}.theory() says {want2}")
    assert not wrong, f"{len(wrong)} counts off:\n" + "\n".join(wrong[:40])


# -------------------------------------------------------------------- reuse, shapes, refusals, world size 1


_SEQUENCE = [  # big, small, empty, multi-dimensional, dtype changes: each call reuses the last one's buffers
    ((17**3,), torch.float32), ((7,), torch.int64), ((2**16 + 1,), torch.float64), ((1,), torch.float16),
    ((0,), torch.float32), ((3, 5), torch.int32), ((2, 3, 4), torch.bfloat16), ((1000,), torch.float32),
    ((17**3,), torch.float32), ((5, 1, 7), torch.float64),
]


def _back_to_back(ctx):
    """Several calls in a row on one Communicator; values chosen so every sum is exact in every dtype."""
    g, failures = ctx.world_size, []
    for alg in ALGORITHMS:
        c = Communicator(timeout_s=30)
        for call, (shape, dtype) in enumerate(_SEQUENCE):
            n = torch.Size(shape).numel()
            pattern = ((torch.arange(n) + 3 * call) % 7 - 3).reshape(shape)  # differs call to call: stale data shows
            t = ((ctx.rank + 1) * pattern).to(dtype)  # |sum| <= 3 * G(G+1)/2 = 18: exact even in bfloat16
            out = allreduce(t, alg, comm=c)
            want = (g * (g + 1) // 2 * pattern).to(dtype)
            if out is not t or t.shape != torch.Size(shape) or not torch.equal(t, want):
                failures.append(f"{alg} call {call} shape {shape} {_name(dtype)} rank {ctx.rank}: got "
                                f"{t.flatten()[:8].tolist()}..., want {want.flatten()[:8].tolist()}...")
    return failures


@pytest.mark.timeout(60)
def test_back_to_back_calls_and_multidimensional_tensors():
    failures = [f for r in run_ranks(_back_to_back, 3, timeout_s=45) for f in r]
    assert not failures, "\n".join(failures)


def _refusals(ctx):
    """Calls refused before any communication, on every rank; the group must still work afterwards."""
    errors = {}

    def attempt(case, *args, **kwargs):
        try:
            allreduce(*args, **kwargs)
            errors[case] = None
        except Exception as e:
            errors[case] = (type(e).__name__, str(e))

    for alg in ALGORITHMS:
        attempt(f"{alg} transposed", torch.ones(3, 4).t(), alg)
        attempt(f"{alg} strided", torch.ones(10)[::2], alg)
    attempt("misspelt", torch.ones(3), "rign")
    attempt("unknown", torch.ones(3), "carrier-pigeon")
    attempt("not a tensor", [1.0, 2.0], "ring")
    attempt("comm and group", torch.ones(3), "ring", dist.group.WORLD, comm=Communicator())
    attempt("complex", torch.ones(3, dtype=torch.complex64), "ring")
    t = torch.ones(5)
    allreduce(t, "ring")  # still in step after all of that
    return errors, t.tolist()


@pytest.mark.timeout(60)
def test_bad_calls_are_refused_on_every_rank():
    for rank, (errors, after) in enumerate(run_ranks(_refusals, 2, timeout_s=45)):
        for alg in ALGORITHMS:
            for case in (f"{alg} transposed", f"{alg} strided"):
                assert errors[case] and errors[case][0] == "ValueError", (rank, case, errors[case])
                assert "contiguous" in errors[case][1], (rank, case, errors[case])
        assert errors["misspelt"][0] == "ValueError" and "Did you mean 'ring'?" in errors["misspelt"][1], errors
        assert errors["unknown"][0] == "ValueError" and "Did you mean" not in errors["unknown"][1], errors
        assert all(a in errors["unknown"][1] for a in ALGORITHMS), errors["unknown"]  # lists the choices
        assert errors["not a tensor"][0] in ("ValueError", "TypeError"), errors
        assert errors["comm and group"][0] == "ValueError", errors
        assert errors["complex"][0] == "TypeError" and "complex64" in errors["complex"][1], errors
        assert after == [2.0] * 5, f"rank {rank}: the group is out of step after refused calls: {after}"


def _world_of_one(ctx):
    """G=1: every algorithm returns the input object untouched and sends nothing (sums: see the sweep)."""
    failures = []
    for alg in ALGORITHMS:
        for dtype in DTYPES:
            c = Communicator(timeout_s=5)
            t = _case(17**3, 1, dtype)[0][0].clone()
            before = t.clone()
            out = allreduce(t, alg, comm=c)
            if out is not t or not torch.equal(t, before) or c.stats.sent_messages or c.stats.recv_messages:
                failures.append(f"{alg} G=1 {_name(dtype)}: not a no-op ({c.stats})")
    return failures


@pytest.mark.timeout(60)
def test_world_size_1_is_a_no_op():
    assert run_ranks(_world_of_one, 1, timeout_s=45) == [[]]


# -------------------------------------------------------------------------------------------- sub-groups


def _subgroups(ctx):
    """Ranks 1 and 3 reduce in their group while 0 and 2 reduce in theirs, at the same time."""
    odd, even, alone = dist.new_group([1, 3]), dist.new_group([0, 2]), dist.new_group([2])  # all ranks call
    group = odd if ctx.rank in (1, 3) else even
    n = 17**3
    out = {}
    for alg in ALGORITHMS:
        t = torch.full((n,), 10**ctx.rank, dtype=torch.int64) + torch.arange(n)  # which ranks were summed shows
        bystander = torch.full((n,), -1, dtype=torch.int64)
        allreduce(t, alg, group)
        lone = None
        if ctx.rank == 2:  # a group of one inside a bigger world: a no-op
            lone = torch.arange(5.0)
            allreduce(lone, alg, alone)
            lone = lone.tolist()
        out[alg] = (int(t[0]), int(t[-1]), bool(torch.equal(t - t[0], 2 * torch.arange(n))),
                    bool((bystander == -1).all()), lone)
    try:  # a mismatch inside the sub-group names the global ranks 1 and 3
        if group is odd:
            allreduce(torch.ones(8 + (ctx.rank == 3)), "ring", group)
        mismatch = None
    except ValueError as e:
        mismatch = str(e)
    return out, mismatch


@pytest.mark.timeout(60)
def test_sub_group_reduces_among_its_members_only():
    results = run_ranks(_subgroups, 4, timeout_s=45)
    n = 17**3
    for rank, (out, mismatch) in enumerate(results):
        members = (1, 3) if rank in (1, 3) else (0, 2)
        first = sum(10**r for r in members)
        for alg, (t0, t_last, ramp, bystander, lone) in out.items():
            assert (t0, t_last, ramp) == (first, first + 2 * (n - 1), True), \
                f"{alg} rank {rank}: group {members} gave t[0]={t0}, want {first} (sum of 10**rank over members)"
            assert bystander, f"{alg} rank {rank}: a tensor never passed to allreduce changed"
            assert lone == ([0.0, 1.0, 2.0, 3.0, 4.0] if rank == 2 else None), (alg, rank, lone)
        if rank in (1, 3):
            assert mismatch and "rank 1" in mismatch and "rank 3" in mismatch, mismatch
        else:
            assert mismatch is None


# ------------------------------------------------------------------------------------------ failing peers


def _silent_peer(ctx, flag):
    """Rank 1 never calls allreduce (it waits, bounded, for rank 0 to finish); rank 0 must time out."""
    if ctx.rank == 1:
        end = time.monotonic() + 20
        while not os.path.exists(flag) and time.monotonic() < end:
            time.sleep(0.02)
        return None
    start = time.monotonic()
    try:
        allreduce(torch.ones(1000), "ring", timeout_s=2, check=False)
        return time.monotonic() - start, None, None
    except Exception as e:
        return time.monotonic() - start, type(e), str(e)
    finally:
        open(flag, "w").close()  # rank 1 may return now


@pytest.mark.timeout(60)
def test_a_silent_peer_is_a_comm_error_naming_algorithm_step_and_ranks(tmp_path):
    (elapsed, kind, message), rank1 = run_ranks(_silent_peer, 2, str(tmp_path / "done"), timeout_s=40)
    assert kind is CommError, f"rank 0 got {kind}: {message}"
    assert 1.9 <= elapsed <= 4.0, f"CommError after {elapsed:.2f} s with timeout_s=2"
    assert "ring" in message and re.search(r"\bstep \d+", message), message
    assert message.startswith("rank 0:") and "rank 1" in message, message
    assert rank1 is None


def _stuck_peer(ctx, flag):
    """Rank 1 makes the groups, then stays alive calling nothing until rank 0 is done. Rank 0 calls a ring
    all-reduce (its first call's length check), a tensor-parallel all-reduce, and an object gather (bounded only
    by its group's own timeout) on a group made with no timeout given: that must be the run's (5 s), not torch's
    30 minutes."""
    group = Mesh.for_world(2, tp=2).build().duplicate("tp")  # new_group without a timeout
    if ctx.rank == 1:
        end = time.monotonic() + 40
        while not os.path.exists(flag) and time.monotonic() < end:
            time.sleep(0.02)
        return None
    out = {}
    try:
        for name, call in (("check", lambda: allreduce(torch.ones(10), "ring", timeout_s=2)),
                           ("tp", lambda: tp_all_reduce(torch.ones(4), group)),
                           ("objects", lambda: gather_objects(1, group, op="the test's gather"))):
            start = time.monotonic()
            try:
                call()
                out[name] = None
            except Exception as e:
                out[name] = (type(e), str(e), time.monotonic() - start)
        return out
    finally:
        open(flag, "w").close()


@pytest.mark.timeout(120)
def test_a_stuck_peer_is_named_in_every_wait_and_groups_keep_the_runs_timeout(tmp_path):
    out, _ = run_ranks(_stuck_peer, 2, str(tmp_path / "done"), timeout_s=80, dist_timeout_s=5)
    starts = {"check": "rank 0: ring all-reduce's check of lengths and dtypes:",
              "tp": "rank 0: tensor-parallel all-reduce", "objects": "rank 0: the test's gather:"}
    for name, start in starts.items():
        assert out[name] is not None, f"{name}: completed without its peer"
        kind, message, waited = out[name]
        assert kind is CommError and message.startswith(start) and "[0, 1]" in message, (name, kind, message)
        assert waited < 15, f"{name}: failed after {waited:.1f} s, with the run's timeout 5 s"


def _mismatches(ctx):
    """Every rank must get a ValueError for each mismatch; afterwards the group still works."""
    algorithms = list(ALGORITHMS)
    seen = {}
    for i, alg in enumerate(algorithms):
        other = algorithms[(i + 1) % len(algorithms)]
        cases = {
            "length": (torch.ones(8 + ctx.rank), alg),
            "dtype": (torch.ones(8, dtype=(torch.float32, torch.float64)[ctx.rank]), alg),
            "algorithm": (torch.ones(8), (alg, other)[ctx.rank]),
        }
        for case, (t, name) in cases.items():
            try:
                allreduce(t, name, timeout_s=10)
                seen[alg, case] = None
            except Exception as e:
                seen[alg, case] = (type(e).__name__, str(e), other)
    t = torch.ones(5)
    allreduce(t, "ring")
    return seen, t.tolist()


@pytest.fixture(scope="module")
def mismatches():
    """Per rank: ``{(algorithm, case): (exception type, message, the other rank's algorithm)}``, group after."""
    return run_ranks(_mismatches, 2, timeout_s=45)


def _mismatch_errors(results, cases, want):
    wrong = []
    for rank, (seen, after) in enumerate(results):
        assert after == [2.0] * 5, f"rank {rank}: the group is out of step after the mismatched calls: {after}"
        for (alg, case), got in seen.items():
            if case not in cases:
                continue
            if got is None or got[0] != "ValueError":
                wrong.append(f"{alg} {case} mismatch rank {rank}: got {got}, want ValueError")
                continue
            _, message, other = got
            missing = [w for w in want(case, alg, other) if not re.search(w, message)]
            if missing:
                wrong.append(f"{alg} {case} mismatch rank {rank}: message lacks {missing}: {message}")
    return wrong


@pytest.mark.timeout(60)
def test_mismatched_length_or_dtype_is_a_value_error_on_every_rank_naming_both(mismatches):
    def want(case, alg, other):
        return {"length": (r"\b8\b", r"\b9\b", "rank 0", "rank 1"), "dtype": ("float32", "float64")}[case]

    wrong = _mismatch_errors(mismatches, ("length", "dtype"), want)
    assert not wrong, "\n".join(wrong)


@pytest.mark.timeout(60)
def test_mismatched_algorithms_are_a_value_error_on_every_rank_naming_both(mismatches):
    # naming the algorithms as the user spelt them, not by their index in ALGORITHMS, is the useful part
    wrong = _mismatch_errors(mismatches, ("algorithm",), lambda _, alg, other: (re.escape(repr(alg)),
                                                                                 re.escape(repr(other))))
    assert not wrong, "\n".join(wrong)


# ----------------------------------------------------------------------------------------------- tracing


def _traced(ctx):
    """One comm span per call, carrying exactly what the Communicator counted."""
    tracer, failures = Tracer(ctx.rank), []
    for alg in ALGORITHMS:
        c = Communicator(timeout_s=30)
        for n in (7, 17**3):
            before_spans = len(tracer.spans)
            s0 = (c.stats.sent_bytes, c.stats.recv_bytes, c.stats.sent_messages)
            allreduce(torch.ones(n), alg, comm=c, tracer=tracer)
            s1 = (c.stats.sent_bytes, c.stats.recv_bytes, c.stats.sent_messages)
            counted = tuple(b - a for a, b in zip(s0, s1, strict=True))
            spans = tracer.spans[before_spans:]
            got = [(s.kind, s.bytes, s.recv_bytes, s.args.get("messages"), alg in s.name) for s in spans]
            if got != [("comm", *counted, True)]:
                failures.append(f"{alg} n={n} rank {ctx.rank}: spans (kind, bytes, recv_bytes, messages, "
                                f"name has {alg!r}) {got}, want one with counted {counted}")
    off = Tracer(ctx.rank, enabled=False)
    allreduce(torch.ones(7), "ring", tracer=off)
    if off.spans:
        failures.append(f"a disabled tracer recorded {off.spans}")
    return failures


@pytest.mark.timeout(60)
def test_tracer_records_one_comm_span_per_call_with_the_counted_bytes():
    failures = [f for r in run_ranks(_traced, 3, timeout_s=45) for f in r]
    assert not failures, "\n".join(failures)


def test_groups_time_out_with_the_run_and_nccls_watchdog_after_the_named_error(monkeypatch):
    import datetime
    import sys
    from types import SimpleNamespace

    from fourfold import launch
    from fourfold.comm.wait import group_timeout

    assert group_timeout(10, "gloo") == datetime.timedelta(seconds=10)
    assert group_timeout(10, "nccl") == datetime.timedelta(seconds=42.5)  # the bounded wait's error first
    assert group_timeout(10, "cpu:gloo,cuda:nccl") == datetime.timedelta(seconds=42.5)  # launch.init's on CUDA
    closed = []
    ctx = SimpleNamespace(close=lambda settle: closed.append(settle))
    launch._close_at_exit(ctx)  # a clean exit waits for the losses still in flight
    monkeypatch.setattr(sys, "last_value", ValueError("uncaught"), raising=False)
    launch._close_at_exit(ctx)  # after an uncaught exception it does not: a peer may never send them
    assert closed == [True, False]
