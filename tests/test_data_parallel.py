"""fourfold.parallel.data.DataParallel: G ranks, each on its shard, equal one process on the concatenated batch.

Processes are the expensive part (each rank's first TinyGPT costs ~1.5 s of CPU), so there are four kinds of
spawn, each read by several tests:

* ``parity`` (one per (world size, dtype)): every algorithm in ``ALGORITHMS`` trains a small TinyGPT for
  ``STEPS`` AdamW steps. Read by: losses and final weights vs the single-process run on the concatenated batch;
  step-0 gradients vs the naive per-parameter ``sync_gradients`` (the oracle), before and after ``finish()``;
  replicas bitwise equal; bytes sent vs each algorithm's ``theory()`` summed over the buckets; bucket layout.
* ``two_ranks`` (G = 2): ``no_sync`` accumulation, and ``find_unused_parameters=True`` training.
* ``refusals`` (G = 3): replicas whose parameters differ, refused at wrap; a parameter no rank used.
* world size 1.

Reading a failure: each line starts ``<algorithm> G=<world size> <dtype>`` and names the parameter, its max
|error| and the first wrong element. A loss already wrong at step 0 (before any update) means the replicas did
not start from rank 0's weights or the shards are not the global batch; right step-0 losses with wrong later
losses or weights mean gradient averaging is wrong, and the ``sync_gradients`` test names the first wrong
gradient (compared right after backward, then after ``finish()``: a difference only in the first means the
averaged gradients are not written when backward ends). ``replicas differ after wrap`` means the broadcast of
rank 0's state is missing. A ``RankError`` means a rank raised or hung inside ``DataParallel``: its message
starts with the same label.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import traceback

import pytest
import torch
from torch import nn

from fourfold.comm import ALGORITHMS
from fourfold.data import BatchLoader, Corpus
from fourfold.models import GPTConfig, TinyGPT
from fourfold.models.gpt import lm_loss
from fourfold.parallel.data import DataParallel, sync_gradients
from fourfold.testing import run_ranks

CFG = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)  # tied embedding / head
BATCH = 12  # divisible by every world size below: the shards are equal, so mean of means = global mean
STEPS = 3
BUCKET_MB = 0.01  # ~10 kB: ~1,300 float64 elements, so the ~34k-parameter model spans several buckets
LR, WEIGHT_DECAY = 1e-2, 0.1
TOL64 = 1e-10
# float32: the runs add the same per-example terms in a different order (G shard means, then their mean, against
# one mean over the whole batch), so gradients differ by a few ulps. Adam divides m by sqrt(v) + eps, which
# amplifies the relative error of gradients near the rounding level: the key bias (qkv.bias[C:2C]) has an exact
# gradient of 0, as softmax ignores a constant added to every key, so in float32 its gradient is pure noise and
# its update is noise too. Measured after 3 steps: max |DP - one process| = 1.6e-5 on that bias, <= 2.4e-6
# elsewhere, and each tensor's error was at most 1.1x the distance float32 rounding alone puts the
# single-process run from float64. That distance is the tolerance's yardstick, so it follows the machine's
# float32 kernels: per tensor, 1e-6 + F32_SLACK x max |one process in float32 - one process in float64|.
# Scale bugs (a missing 1/G) barely move Adam; the exact G = 2 float32 comparison with sync_gradients and the
# float64 runs catch those.
F32_SLACK = 4.0
LOSS_TOL32 = 1e-5  # losses ~ln(256) = 5.5: 1e-5 is ~20 float32 ulps of the loss


def _corpus() -> Corpus:
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, 256, (8192,), generator=g, dtype=torch.uint8)
    return Corpus.from_bytes(bytes(data.tolist()), "random-8k")


def _loader(rank: int = 0, world_size: int = 1) -> BatchLoader:
    return BatchLoader(_corpus(), batch_size=BATCH, seq_len=CFG.seq_len, seed=0, dp_rank=rank, dp_size=world_size)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name, a tied weight once (as ``named_parameters`` lists it)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _digest(model: nn.Module) -> str:
    """sha256 of every parameter's and buffer's bytes, in name order: equal digests = bitwise equal replicas."""
    h = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _compare(got: dict, want: dict, tol: float | dict[str, float] | None, label: str) -> list[str]:
    """What differs between two name -> tensor dicts (exactly when ``tol`` is None), one line per tensor.

    ``tol``: one absolute tolerance, or one per name.

    The single place where sharded results meet the reference: every test reads its failures from here.
    """
    problems = []
    if list(got) != list(want):
        return [f"{label}: names differ: got {list(got)}, want {list(want)}"]
    for name, w in want.items():
        g, t = got[name], tol[name] if isinstance(tol, dict) else tol
        if g is None or w is None:
            if (g is None) != (w is None):
                problems.append(f"{label}: {name}: got {'None' if g is None else 'a tensor'}, want "
                                f"{'None' if w is None else 'a tensor'}")
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            problems.append(f"{label}: {name}: got {g.dtype} {tuple(g.shape)}, want {w.dtype} {tuple(w.shape)}")
            continue
        err = (g.double() - w.double()).abs()
        bad = err != 0 if t is None else ~(err <= t)  # written so that NaN fails
        if bool(bad.any()):
            i = tuple(int(v) for v in bad.nonzero()[0])
            problems.append(f"{label}: {name}: {int(bad.sum())} of {g.numel()} elements off, max |error| "
                            f"{err.max().item():.3g} > {t or 0:.3g}; first at {i}: got "
                            f"{g[i].item()!r}, want {w[i].item()!r}")
    return problems


def _reference(dtype: torch.dtype, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole global batch of each step: (losses, final parameters). The golden run."""
    model = TinyGPT(CFG, seed=0, dtype=dtype)
    opt = _optimizer(model)
    loader = _loader()
    losses = []
    for step in range(steps):
        x, y = loader.global_batch(step)  # (B, T), (B, T)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, _params(model)


_REFERENCES: dict[torch.dtype, tuple[list[float], dict[str, torch.Tensor]]] = {}


def _cached_reference(dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    if dtype not in _REFERENCES:
        _REFERENCES[dtype] = _reference(dtype)
    return _REFERENCES[dtype]


def _theory(alg: str):
    """``fourfold.comm.<alg>.theory(numel, G, rank, itemsize) -> (sent_bytes, messages)``, when there is one."""
    name = f"fourfold.comm.{alg}"
    if importlib.util.find_spec(name) is None:
        return None
    return getattr(importlib.import_module(name), "theory", None)


# ------------------------------------------------------------------------ parity: one spawn per (G, dtype)


def _oracle_gradients(alg: str, dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Rank 0's initial weights, this rank's shard, plain backward + ``sync_gradients``: the naive sibling."""
    model = TinyGPT(CFG, seed=0, dtype=dtype)
    _, loss = model(x, y)
    loss.backward()
    sync_gradients(model.parameters(), None, algorithm=alg)
    return _grads(model)


def _train_every_algorithm(ctx, dtype_name: str) -> dict:
    """Per algorithm: STEPS AdamW steps of DataParallel(TinyGPT) on this rank's shard, and what they left.

    Step 0 also holds the gradients against the oracle twice: right after backward with no finish() call (the
    last bucket completing in backward must have written them), and after finish() twice (idempotent: nothing
    changes, nothing more is sent).
    """
    dtype = getattr(torch, dtype_name)
    rank, world_size = ctx.rank, ctx.world_size
    # G = 2: every algorithm computes fl(g0 + g1) whatever the chunking, so bucketed == per-parameter bitwise.
    # G > 2: the ring's (and gloo's) summation order for an element depends on its offset in the buffer it
    # travels in, which differs between a bucket and a lone parameter: a few ulps of ~1 (float64 here).
    oracle_tol = None if world_size == 2 else 1e-14
    out = {}
    for alg in ALGORITHMS:
        label = f"{alg} G={world_size} {dtype_name} rank {rank}"
        oracle_failures = []
        try:
            loader = _loader(rank, world_size)
            oracle = _oracle_gradients(alg, dtype, *loader.shard(0))
            # Every rank but 0 starts from other weights: the wrap must broadcast rank 0's.
            model = TinyGPT(CFG, seed=0 if rank == 0 else 100 + rank, dtype=dtype)
            dp = DataParallel(model, algorithm=alg, bucket_mb=BUCKET_MB, timeout_s=30)
            after_wrap = _digest(model)
            opt = _optimizer(model)
            losses, sent = [], []
            for step in range(STEPS):
                x, y = loader.shard(step)  # (B/G, T), (B/G, T)
                opt.zero_grad(set_to_none=True)
                before = (dp.stats.sent_bytes, dp.stats.sent_messages)
                _, loss = dp(x, y)
                loss.backward()
                if step == 0:
                    oracle_failures += _compare(_grads(model), oracle, oracle_tol,
                                                f"{label}: step 0 after backward, no finish() call")
                    sent_by_backward = dp.stats.sent_bytes
                    dp.finish()
                    dp.finish()
                    oracle_failures += _compare(_grads(model), oracle, oracle_tol,
                                                f"{label}: step 0 after finish() twice")
                    if dp.stats.sent_bytes != sent_by_backward:
                        oracle_failures.append(f"{label}: finish() after backward sent "
                                               f"{dp.stats.sent_bytes - sent_by_backward} more bytes")
                dp.finish()
                sent.append((dp.stats.sent_bytes - before[0], dp.stats.sent_messages - before[1]))
                opt.step()
                losses.append(loss.item())
        except Exception as e:
            raise RuntimeError(f"{label}: {type(e).__name__}: {e}") from e
        theory = _theory(alg)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        expected = None
        if theory is not None:  # computed here: hierarchical's node size comes from this rank's environment
            costs = [theory(b.numel, world_size, rank, itemsize) for b in dp.buckets]
            expected = (sum(c[0] for c in costs), sum(c[1] for c in costs))
        out[alg] = {
            "losses": losses,
            "params": _params(model) if rank == 0 else None,
            "after_wrap": after_wrap,
            "final": _digest(model),
            "oracle_failures": oracle_failures,
            "sent": sent,
            "expected_sent": expected,
            # Bucket.names lists the parameter names (Bucket.params holds the Parameters themselves)
            "buckets": [(list(b.names), b.numel) for b in dp.buckets],
            "module_is_model": dp.module is model,
        }
    return out


PARITY_CASES = [(2, "float64"), (3, "float64"), (4, "float64"), (2, "float32")]


@pytest.fixture(scope="module", params=PARITY_CASES, ids=lambda c: f"G{c[0]}-{c[1]}")
def parity(request):
    """(world size, dtype name, per-rank results of ``_train_every_algorithm``): one spawn, read by 5 tests."""
    world_size, dtype_name = request.param
    return world_size, dtype_name, run_ranks(_train_every_algorithm, world_size, dtype_name, timeout_s=90)


@pytest.mark.timeout(120)
def test_losses_and_weights_equal_one_process_on_the_whole_batch(parity):
    world_size, dtype_name, results = parity
    dtype = getattr(torch, dtype_name)
    want_losses, want_params = _cached_reference(dtype)
    tol: float | dict[str, float] = TOL64
    loss_tol = TOL64
    if dtype == torch.float32:  # see F32_SLACK
        exact = _cached_reference(torch.float64)[1]
        tol = {n: 1e-6 + F32_SLACK * (w.double() - exact[n]).abs().max().item() for n, w in want_params.items()}
        loss_tol = LOSS_TOL32
    failures = []
    for alg in ALGORITHMS:
        label = f"{alg} G={world_size} {dtype_name}"
        # the global loss is the mean of the equal shards' mean losses
        losses = [sum(r[alg]["losses"][s] for r in results) / world_size for s in range(STEPS)]
        for step, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
            if not abs(got - want) <= loss_tol:
                failures.append(f"{label}: loss at step {step}: got {got!r}, want {want!r} "
                                f"(|error| {abs(got - want):.3g} > {loss_tol})")
        failures += _compare(results[0][alg]["params"], want_params, tol, f"{label} after {STEPS} steps")
    assert not failures, f"{len(failures)} mismatches against one process:\n" + "\n".join(failures[:40])


@pytest.mark.timeout(120)
def test_gradients_equal_the_naive_per_parameter_sync_gradients(parity):
    world_size, dtype_name, results = parity
    failures = [f for r in results for alg in ALGORITHMS for f in r[alg]["oracle_failures"]]
    assert not failures, f"{len(failures)} mismatches against sync_gradients:\n" + "\n".join(failures[:40])


@pytest.mark.timeout(120)
def test_replicas_are_bitwise_identical_after_wrap_and_after_training(parity):
    world_size, dtype_name, results = parity
    failures = []
    for alg in ALGORITHMS:
        for key, when in (("after_wrap", "after wrap (rank 0's weights broadcast)"), ("final", "after training")):
            digests = [r[alg][key] for r in results]
            if len(set(digests)) > 1:
                failures.append(f"{alg} G={world_size} {dtype_name}: replicas differ {when}: "
                                + ", ".join(f"rank {i} {d[:12]}" for i, d in enumerate(digests)))
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
def test_bytes_sent_per_step_match_each_algorithms_theory_over_the_buckets(parity):
    world_size, dtype_name, results = parity
    wrong = []
    for alg in ALGORITHMS:
        if alg == "native":  # gloo's own traffic is not counted
            continue
        for rank, r in enumerate(results):
            res = r[alg]
            label = f"{alg} G={world_size} {dtype_name} rank {rank}"
            if any(b == 0 for b, _ in res["sent"]):
                wrong.append(f"{label}: a step sent nothing: (bytes, messages) per step {res['sent']}")
            if res["expected_sent"] is not None and any(tuple(s) != res["expected_sent"] for s in res["sent"]):
                wrong.append(f"{label}: (bytes, messages) per step {res['sent']}, theory() summed over the "
                             f"buckets says {res['expected_sent']}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.timeout(120)
def test_buckets_hold_every_parameter_once_tied_weight_once(parity):
    world_size, dtype_name, results = parity
    model = TinyGPT(CFG, dtype=getattr(torch, dtype_name))
    names = [n for n, _ in model.named_parameters()]  # the tied head weight is embed.wte.weight
    numel = {n: p.numel() for n, p in model.named_parameters()}
    itemsize = torch.empty(0, dtype=getattr(torch, dtype_name)).element_size()
    cap = BUCKET_MB * 2**20  # the larger of the MB / MiB readings: the fill check below holds under either
    failures = []
    for alg in ALGORITHMS:
        for rank, r in enumerate(results):
            res = r[alg]
            label = f"{alg} G={world_size} {dtype_name} rank {rank}"
            if not res["module_is_model"]:
                failures.append(f"{label}: dp.module is not the wrapped module")
            buckets = res["buckets"]
            kinds = sorted({p for params, _ in buckets for p in params if p not in numel})
            if kinds:
                failures.append(f"{label}: Bucket.names must list parameter names, got entries {kinds} that "
                                "are not names of the model's parameters")
                continue
            if buckets != results[0][alg]["buckets"]:
                failures.append(f"{label}: bucket layout differs from rank 0's")
            listed = [n for params, _ in buckets for n in params]
            if sorted(listed) != sorted(names):
                missing = sorted(set(names) - set(listed))
                twice = sorted({n for n in listed if listed.count(n) > 1})
                failures.append(f"{label}: buckets must hold each parameter exactly once: missing {missing}, "
                                f"twice {twice}")
            if len(buckets) < 3:
                failures.append(f"{label}: bucket_mb={BUCKET_MB} should cut {sum(numel.values())} parameters "
                                f"into several buckets, got {len(buckets)}")
            if sum(n for _, n in buckets) != model.num_parameters():
                failures.append(f"{label}: buckets hold {sum(n for _, n in buckets)} elements, the model "
                                f"{model.num_parameters()} (tied weight once)")
            for i, (params, n) in enumerate(buckets):
                if n != sum(numel[p] for p in params):
                    failures.append(f"{label}: bucket {i} numel {n} != the sum over its parameters "
                                    f"{sum(numel[p] for p in params)}")
                if len(params) > 1 and (n - numel[params[-1]]) * itemsize >= cap:
                    failures.append(f"{label}: bucket {i} was already full ({(n - numel[params[-1]]) * itemsize}"
                                    f" B >= {cap:g} B) before its last parameter {params[-1]} joined it")
    assert not failures, "\n".join(failures[:40])


# ------------------------------------------------------------------------------------- world size 1


def _world_of_one(ctx) -> list[str]:
    x, y = _loader().global_batch(0)
    plain = TinyGPT(CFG, seed=0, dtype=torch.float64)
    _, want_loss = plain(x, y)
    want_loss.backward()
    failures = []
    for alg in ("native", "ring"):
        model = TinyGPT(CFG, seed=0, dtype=torch.float64)
        dp = DataParallel(model, algorithm=alg, bucket_mb=BUCKET_MB)
        failures += _compare(_params(model), _params(plain), None, f"{alg} G=1: weights changed by the wrap")
        _, loss = dp(x, y)
        loss.backward()
        dp.finish()
        if not torch.equal(loss, want_loss):
            failures.append(f"{alg} G=1: loss {loss.item()!r}, plain module {want_loss.item()!r}")
        failures += _compare(_grads(model), _grads(plain), None, f"{alg} G=1 gradients")
        s = dp.stats
        if (s.sent_bytes, s.sent_messages, s.recv_bytes, s.recv_messages) != (0, 0, 0, 0):
            failures.append(f"{alg} G=1: communicated: {s}")
    return failures


@pytest.mark.timeout(60)
def test_world_size_1_is_the_plain_module_with_no_communication():
    assert run_ranks(_world_of_one, 1, timeout_s=45) == [[]]


# ------------------------------------------------- two ranks: no_sync accumulation and unused parameters


class _Branchy(nn.Module):
    """TinyGPT with a residual side branch ``aux`` after the embedding, taken only when ``use_aux``.

    ``scale`` is a buffer every rank sets differently before the wrap; the wrap must broadcast rank 0's.
    """

    def __init__(self, rank: int = 0) -> None:
        super().__init__()
        self.gpt = TinyGPT(CFG, seed=0, dtype=torch.float64)
        g = torch.Generator().manual_seed(5)
        self.aux = nn.Linear(CFG.d_model, CFG.d_model, dtype=torch.float64)
        with torch.no_grad():
            self.aux.weight.copy_(torch.randn(self.aux.weight.shape, generator=g, dtype=torch.float64) * 0.02)
            self.aux.bias.zero_()
        self.register_buffer("scale", torch.tensor(1.0 + rank, dtype=torch.float64))

    use_aux = False  # what forward(idx) alone takes: the logits (fourfold.parallelize's engine passes no more)

    def forward(self, idx, targets=None, use_aux: bool | None = None):
        x = self.gpt.embed(idx) * self.scale  # (B, T, C)
        if self.use_aux if use_aux is None else use_aux:
            x = x + self.aux(x)  # (B, T, C)
        for block in self.gpt.blocks:
            x = block(x)  # (B, T, C)
        logits = self.gpt.head(x)
        return logits if targets is None else lm_loss(logits, targets)


def _branchy_reference(world_size: int, uses_aux: list[tuple[bool, bool]], steps: int) -> dict[str, torch.Tensor]:
    """Each rank's shard in two halves, ``uses_aux[rank]`` saying which take the branch: the gradients summed
    over the halves and averaged over the ranks, in one process; None where nothing used a parameter (AdamW then
    skips it: no weight decay), as one process leaves it."""
    model = _Branchy()
    opt = _optimizer(model)
    for step in range(steps):
        total: dict[str, torch.Tensor | None] = dict.fromkeys(n for n, _ in model.named_parameters())
        for rank in range(world_size):
            x, y = _loader(rank, world_size).shard(step)
            half = x.size(0) // 2
            for part, use in zip((slice(0, half), slice(half, None)), uses_aux[rank], strict=True):
                model.zero_grad(set_to_none=True)
                (model(x[part], y[part], use_aux=use) / 2).backward()
                for n, p in model.named_parameters():
                    if p.grad is not None:
                        total[n] = p.grad.clone() if total[n] is None else total[n] + p.grad
        for n, p in model.named_parameters():
            t = total[n]
            p.grad = None if t is None else t / world_size
        opt.step()
    return _params(model)


ACCUMULATE_STEPS = 2
UNUSED_STEPS = 2
# case -> per rank, whether the aux branch is taken in the first half of its shard (under no_sync) and the second
UNUSED_CASES = {"unused everywhere": [(False, False), (False, False)],
                "used on rank 1 only": [(False, False), (True, True)],
                "used under no_sync only": [(True, False), (False, False)]}


def _accumulate(ctx) -> dict:
    """Each step: half the local shard under no_sync, then the other half synced; losses scaled by 1/2.
    Gradients are dropped before step 0 and zeroed in place before step 1."""
    model = TinyGPT(CFG, seed=0, dtype=torch.float64)
    dp = DataParallel(model, algorithm="ring", bucket_mb=BUCKET_MB, timeout_s=20)
    opt = _optimizer(model)
    loader = _loader(ctx.rank, ctx.world_size)
    quiet, loud = [], []
    for step in range(ACCUMULATE_STEPS):
        x, y = loader.shard(step)  # (B/G, T)
        half = x.size(0) // 2
        # Step 1 zeroes in place: the gradients are then views of the buckets (finish() left them so), and
        # both backwards accumulate into the buckets themselves.
        opt.zero_grad(set_to_none=step == 0)
        start = dp.stats.sent_bytes
        with dp.no_sync():
            _, loss = dp(x[:half], y[:half])
            (loss / 2).backward()
        quiet.append(dp.stats.sent_bytes - start)
        _, loss = dp(x[half:], y[half:])
        (loss / 2).backward()
        dp.finish()
        loud.append(dp.stats.sent_bytes - start)
        opt.step()
    return {"quiet": quiet, "loud": loud, "params": _params(model), "digest": _digest(model)}


def _train_branchy(ctx, uses: tuple[bool, bool]) -> dict:
    model = _Branchy(ctx.rank)
    dp = DataParallel(model, algorithm="ring", bucket_mb=BUCKET_MB, timeout_s=20, find_unused_parameters=True)
    scale = model.scale.item()
    opt = _optimizer(model)
    for step in range(UNUSED_STEPS):
        x, y = _loader(ctx.rank, ctx.world_size).shard(step)
        half = x.size(0) // 2
        opt.zero_grad(set_to_none=True)
        with dp.no_sync():  # the first half accumulates locally, the second syncs the sum
            (dp(x[:half], y[:half], use_aux=uses[0]) / 2).backward()
        (dp(x[half:], y[half:], use_aux=uses[1]) / 2).backward()
        dp.finish()
        opt.step()
    return {"params": _params(model), "digest": _digest(model), "scale": scale,
            "aux_grad": model.aux.weight.grad is not None}


def _engine_branchy(ctx) -> dict:
    """The same through fourfold.parallelize: rank 1 takes the branch every step, rank 0 never."""
    from fourfold import Layout, Mesh, parallelize

    model = _Branchy()
    model.use_aux = ctx.rank == 1
    engine = parallelize(model, Mesh.for_world(2, dp=2).build(20), Layout(find_unused_parameters=True))
    opt = torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(UNUSED_STEPS):
        engine.step(*_loader(ctx.rank, ctx.world_size).shard(step))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": dict(engine.state_dict())}


def _two_ranks(ctx) -> dict:
    """Each case guarded, so that one failing still lets the others report (all fail alike on both ranks)."""
    cases = {"no_sync": (_accumulate,)}
    cases.update({case: (_train_branchy, uses[ctx.rank]) for case, uses in UNUSED_CASES.items()})
    cases["engine"] = (_engine_branchy,)
    out = {}
    for case, (fn, *args) in cases.items():
        try:
            out[case] = fn(ctx, *args)
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            out[case] = {"error": f"rank {ctx.rank}: {type(e).__name__}: {e} "
                                  f"[raised at {os.path.basename(where.filename)}:{where.lineno}: {where.line}]"}
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_ranks, 2, timeout_s=60)


def _errors(results: list[dict], case: str) -> str:
    return "\n".join(r[case]["error"] for r in results if "error" in r[case])


@pytest.mark.timeout(90)
def test_no_sync_accumulation_over_two_micro_steps_equals_one_step_on_the_whole_batch(two_ranks):
    errors = _errors(two_ranks, "no_sync")
    assert not errors, errors
    results = [r["no_sync"] for r in two_ranks]
    for rank, r in enumerate(results):
        assert r["quiet"] == [0] * ACCUMULATE_STEPS, f"rank {rank}: backward under no_sync sent {r['quiet']} B"
        assert all(b > 0 for b in r["loud"]), f"rank {rank}: the synced backward sent {r['loud']} bytes"
    assert results[0]["digest"] == results[1]["digest"], "replicas differ after accumulated steps"
    _, want = _reference(torch.float64, ACCUMULATE_STEPS)
    failures = _compare(results[0]["params"], want, TOL64, f"no_sync G=2 float64 after {ACCUMULATE_STEPS} steps")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(UNUSED_CASES))
def test_find_unused_parameters_trains_as_one_process_does(two_ranks, case):
    errors = _errors(two_ranks, case)
    assert not errors, errors
    results = [r[case] for r in two_ranks]
    assert [r["scale"] for r in results] == [1.0, 1.0], "the wrap did not broadcast rank 0's buffer"
    assert results[0]["digest"] == results[1]["digest"], f"{case}: replicas differ after training"
    want = _branchy_reference(2, UNUSED_CASES[case], UNUSED_STEPS)
    failures = _compare(results[0]["params"], want, TOL64, f"find_unused_parameters=True, aux {case}")
    assert not failures, "\n".join(failures)
    # used by no rank: no gradient, as one process (AdamW skips it); used anywhere: the averaged one on every rank
    assert [r["aux_grad"] for r in results] == [case != "unused everywhere"] * 2, (case, results)


@pytest.mark.timeout(90)
def test_find_unused_parameters_through_parallelize_trains_as_one_process_does(two_ranks):
    errors = _errors(two_ranks, "engine")
    assert not errors, errors
    want = _branchy_reference(2, UNUSED_CASES["used on rank 1 only"], UNUSED_STEPS)
    got = {n: t for n, t in two_ranks[0]["engine"]["params"].items() if n in want}
    assert set(got) == set(want)
    failures = _compare(got, want, TOL64, "Layout(find_unused_parameters=True), aux used on rank 1 only")
    assert not failures, "\n".join(failures)


# ------------------------------------------------ three ranks: refused at wrap, and an unused parameter


class _WithExtra(nn.Module):
    """TinyGPT plus a small Linear ``extra``, which ``_model_for`` removes on every rank but one."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT(CFG, seed=0, dtype=torch.float64)
        self.extra = nn.Linear(2, 2, dtype=torch.float64)


def _model_for(case: str, rank: int) -> nn.Module:
    """The model rank ``rank`` wraps in ``case``: every rank's agrees with rank 0's but the one named below."""
    if case == "d_model" and rank == 1:
        return TinyGPT(GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=64), dtype=torch.float64)
    if case == "extra":
        model = _WithExtra()
        if rank != 2:
            del model.extra  # rank 2 alone holds extra.weight and extra.bias
        return model
    model = TinyGPT(CFG, seed=0, dtype=torch.float32 if case == "dtype" and rank == 1 else torch.float64)
    if case == "shape" and rank == 2:
        model.blocks[1].mlp.fc.bias = nn.Parameter(torch.zeros(7, dtype=torch.float64))
    return model


LAYOUT_CASES = {  # case -> (names of which the message must name one, None: any parameter; the rank that differs)
    "d_model": (None, 1),  # every parameter's shape differs: naming any one will do
    "extra": (("extra.weight", "extra.bias"), 2),
    "dtype": (None, 1),
    "shape": (("blocks.1.mlp.fc.bias",), 2),
}


def _refusals(ctx) -> dict:
    messages = {}
    for case in LAYOUT_CASES:
        model = _model_for(case, ctx.rank)
        try:
            DataParallel(model, algorithm="ring", bucket_mb=BUCKET_MB, timeout_s=20)
            messages[case] = "no error"
        except ValueError as e:
            messages[case] = f"ValueError: {e}"
    # the refusals must leave the group usable: one ordinary step afterwards
    model = TinyGPT(CFG, seed=0, dtype=torch.float64)
    dp = DataParallel(model, algorithm="ring", bucket_mb=BUCKET_MB, timeout_s=20)
    x, y = _loader(ctx.rank, ctx.world_size).shard(0)
    _, loss = dp(x, y)
    loss.backward()
    dp.finish()
    # last, as it may leave buckets half reduced: a branch no rank takes, without find_unused_parameters
    unused = DataParallel(_Branchy(ctx.rank), algorithm="ring", bucket_mb=BUCKET_MB, timeout_s=20)
    try:
        unused(x, y).backward()
        unused.finish()
        error = "no error"
    except RuntimeError as e:
        error = f"RuntimeError: {e}"
    return {"messages": messages, "digest": _digest(model), "unused": error}


@pytest.fixture(scope="module")
def refusals():
    return run_ranks(_refusals, 3, timeout_s=60)


@pytest.mark.timeout(90)
def test_different_parameters_across_ranks_are_a_value_error_on_every_rank_naming_them(refusals):
    failures = []
    for case, (params, odd) in LAYOUT_CASES.items():
        names = params or [n for n, _ in _model_for(case, 0).named_parameters()]
        for rank, r in enumerate(refusals):
            msg = r["messages"][case]
            label = f"{case} (rank {odd} differs) rank {rank}"
            if not msg.startswith("ValueError"):
                failures.append(f"{label}: want a ValueError, got {msg}")
                continue
            if not any(n in msg for n in names):
                failures.append(f"{label}: message must name {' or '.join(params or ['a parameter'])}: {msg}")
            if not re.search(rf"\brank {odd}\b", msg):
                failures.append(f"{label}: message must name rank {odd}: {msg}")
    assert not failures, "\n".join(failures)
    assert len({r["digest"] for r in refusals}) == 1, "a step after the refusals left the replicas different"


@pytest.mark.timeout(90)
def test_an_unused_parameter_is_a_runtime_error_naming_it(refusals):
    for rank, r in enumerate(refusals):
        assert r["unused"].startswith("RuntimeError"), f"rank {rank}: want a RuntimeError, got {r['unused']}"
        assert "aux.weight" in r["unused"] or "aux.bias" in r["unused"], (
            f"rank {rank}: the message must name the unused parameter (aux.weight / aux.bias): {r['unused']}")


def _stuck_during_sync(ctx, flag):
    """Rank 1 builds the engine, then stays alive calling nothing; rank 0's backward queues every bucket's ring
    all-reduce on the communication thread. The first fails after the 2-s timeout; the rest must fail at once
    with it, not wait 2 s each (the interpreter's exit waits for that queue)."""
    import time

    from fourfold import Layout, Mesh, parallelize

    cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)
    engine = parallelize(TinyGPT(cfg, seed=0), Mesh.for_world(2, dp=2).build(2),
                         Layout(allreduce="ring", bucket_mb=1e-4), loss_fn=lm_loss)
    if ctx.rank == 1:
        end = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < end:
            time.sleep(0.02)
        return None
    try:
        x = torch.randint(0, 64, (2, 8))
        try:
            engine.step(x, x)
            return "no error"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        start = time.monotonic()
        engine.dp._executor.shutdown(wait=True)  # what the interpreter's exit does
        return error, time.monotonic() - start, len(engine.dp.buckets)
    finally:
        open(flag, "w").close()


@pytest.mark.timeout(120)
def test_a_failed_bucket_fails_the_ones_queued_behind_it_at_once(tmp_path):
    (error, drained, buckets), _ = run_ranks(_stuck_during_sync, 2, str(tmp_path / "done"), timeout_s=100)
    assert error.startswith("CommError: rank 0:") and "ring" in error, error
    assert buckets > 3 and drained < 2, (buckets, drained)  # not 2 s for each of the buckets queued behind it
