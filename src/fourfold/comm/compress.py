"""Gradient compression for data parallelism: fewer bytes on the wire for a gradient that is nearly the same.

The exact algorithms in :mod:`fourfold.comm` move at least 2(G-1)N/G elements per rank (the ring's bound); the
only way below it is to send fewer bits per element, or fewer numbers. Three ways, each a data-parallel option
(``parallelize(compress=...)``, ``fourfold train --compress``):

| compress | what crosses the wire | bytes per rank vs float32 ring | exact? |
|---|---|---|---|
| ``bf16`` | the bucket in bfloat16 (``reduce_dtype``) | 1/2 | rounds each element to 8 bits of mantissa |
| ``int8`` | :class:`Int8`: each segment as int8 with one float32 scale, error feedback | about 1/4 | no; errors fed back |
| ``powersgd`` | :class:`PowerSGD`: each weight matrix as rank-r factors P (n x r) and Q (m x r) | (n+m)r / nm | no; errors fed back |

**Error feedback.** What compression drops from this step's gradient is kept (the *error*) and added to the next
step's before compressing, so nothing is lost, only delayed: the sum of what was sent over steps follows the sum
of the true gradients. That is what lets int8 and PowerSGD train to the loss of the uncompressed run.

**Every rank ends with bitwise the same gradient**, as with the exact algorithms (the replicas must not drift):
int8's owner of a segment quantizes its sum once and every rank dequantizes the same bytes; PowerSGD's factors
are all-reduced (bitwise the same on every rank) and orthogonalised by the same deterministic QR.

A compressor is stateful (errors, PowerSGD's warm-started Q): one instance per data-parallel wrapper, keyed by
bucket. ``reduce(comm, key, flat, shapes, algorithm)`` sums ``flat`` over ``comm``'s group in place, like an
all-reduce; ``shapes`` are the ``(offset, shape)`` of the parameters packed in ``flat``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fourfold.comm import ring
from fourfold.comm.p2p import Communicator

__all__ = ["COMPRESSIONS", "Compressor", "Int8", "PowerSGD", "make_compressor"]

COMPRESSIONS = ("none", "bf16", "int8", "powersgd")
"""The names ``compress`` takes; ``bf16`` is ``reduce_dtype=torch.bfloat16`` (no state, no error feedback)."""

Shapes = Sequence[tuple[int, torch.Size]]
BLOCK = 256  # int8: elements per float32 scale (4/256 bytes more per element: 3.94x fewer than float32)


class Compressor:
    """A lossy, stateful all-reduce of a data-parallel bucket (see the module docstring)."""

    name = ""
    _restored: dict[str, torch.Tensor]  # from a checkpoint: taken by each bucket's state when it is made

    def reduce(self, comm: Communicator, key: int, flat: torch.Tensor, shapes: Shapes, algorithm: str) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state (its errors fed back, PowerSGD's factors and step counts), flat names -> tensors:
        what a checkpoint keeps so that a resumed run continues exactly. Empty for a stateless compressor."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take ``state`` (a :meth:`state_dict` of the same compressor on the same rank and layout); each bucket
        takes its part when its state is made, at its first reduce after loading."""
        self._restored = dict(state)

    def _restore(self, key: int, tensors: dict[str, torch.Tensor]) -> bool:
        """Copy the restored ``{key}/{name}`` entries into ``tensors`` (the bucket's new state) where every one is
        there with the same shape; True if they were."""
        restored = getattr(self, "_restored", {})
        got = {n: restored.pop(f"{key}/{n}", None) for n in tensors}
        if any(v is None or v.shape != tensors[n].shape for n, v in got.items()):
            return False
        for n, t in tensors.items():
            t.copy_(got[n])  # type: ignore[arg-type]
        return True


def _quantize(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``x`` (up to ``L`` elements, ``L`` a multiple of :data:`BLOCK`) into ``out`` (``L + 4 L / BLOCK``
    int8s) as int8, rounded to nearest of x / scale with one float32 scale (max |x| / 127) per block, the scales
    after the values (``x`` zero-padded to ``L``); return what the receiver will read back, in ``x``'s dtype."""
    blocks = out.numel() // (BLOCK + 4)
    padded = x.new_zeros(blocks * BLOCK)
    padded[:x.numel()] = x
    rows = padded.view(blocks, BLOCK)
    scale = (rows.abs().amax(dim=1) / 127).to(torch.float32)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale will do
    out[:blocks * BLOCK].copy_(torch.round(rows / scale.to(x.dtype)[:, None]).clamp_(-127, 127).view(-1))
    out[blocks * BLOCK:].copy_(scale.view(torch.int8))
    return _dequantize(out, x.numel(), x.dtype)


def _dequantize(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``n`` values :func:`_quantize` wrote into ``packed``, in ``dtype``."""
    blocks = packed.numel() // (BLOCK + 4)
    scale = packed[blocks * BLOCK:].clone().view(torch.float32).to(dtype)
    return (packed[:blocks * BLOCK].to(dtype).view(blocks, BLOCK) * scale[:, None]).view(-1)[:n]


def _layout(numel: int, world_size: int) -> tuple[list[tuple[int, int]], int]:
    """Int8's segments ``[(offset, length)]`` (each at most ``L`` elements, ``L`` the whole segment length
    rounded up to :data:`BLOCK`; the last ones shorter or empty) and the bytes ``C`` of one packed segment.
    Every packed segment has the same size, so the ring's all-gather moves them as they are."""
    span = -(-max(-(-numel // world_size), 1) // BLOCK) * BLOCK
    segs = [(min(j * span, numel), max(min((j + 1) * span, numel) - j * span, 0)) for j in range(world_size)]
    return segs, span + 4 * (span // BLOCK)


@dataclass
class _Int8State:
    error: torch.Tensor        # what quantizing this rank's gradient dropped (whole bucket; own segment 0)
    owner_error: torch.Tensor  # what quantizing this rank's summed segment dropped
    packed: torch.Tensor       # G packed segments (int8 values, then their scales), C bytes each
    inbox: torch.Tensor        # the other ranks' packed copies of this rank's segment (G-1 x C)


class Int8(Compressor):
    """int8 all-reduce with error feedback: a reduce-scatter and an all-gather, each of int8 segments.

    Rank i owns segment i. It adds its error to its gradient, quantizes every other segment (a float32 scale per
    :data:`BLOCK` elements) and sends segment j to rank j (an all-to-all, G-1 messages); each owner sums its
    segment (its own exactly, the others dequantized), adds its owner error, quantizes the sum, and the ring
    all-gathers the packed sums; every rank dequantizes the same bytes. Each rank sends 2(G-1) packed segments
    of ``L (1 + 4 / BLOCK)`` bytes, L about N/G: the ring's element count at about one byte each, 3.9x fewer
    bytes than a float32 ring. See :meth:`theory`.
    """

    name = "int8"

    def __init__(self) -> None:
        self._state: dict[int, _Int8State] = {}

    def reduce(self, comm: Communicator, key: int, flat: torch.Tensor, shapes: Shapes, algorithm: str) -> None:
        g, me = comm.size, comm.rank
        segs, size = _layout(flat.numel(), g)
        st = self._state.get(key)
        if st is None or st.error.numel() != flat.numel():
            st = self._state[key] = _Int8State(
                torch.zeros_like(flat), flat.new_zeros(segs[me][1]),
                torch.empty(g * size, dtype=torch.int8, device=flat.device),
                torch.empty(max(g - 1, 1), size, dtype=torch.int8, device=flat.device))
            self._restore(key, {"error": st.error, "owner_error": st.owner_error})
        chunk = st.packed.view(g, size)
        flat.add_(st.error)
        others = [(me + s) % g for s in range(1, g)]
        for j in others:  # this rank's part of every other segment: quantized, what it dropped kept
            o, n = segs[j]
            sent = _quantize(flat[o:o + n], chunk[j])
            torch.sub(flat[o:o + n], sent, out=st.error[o:o + n])
        comm.exchange([(j, chunk[j]) for j in others], [(j, st.inbox[k]) for k, j in enumerate(others)],
                      algorithm="int8", step=0, phase="reduce-scatter",
                      offsets=([segs[j][0] for j in others], [segs[me][0]] * len(others)))
        o, n = segs[me]
        total = flat[o:o + n]
        for k in range(len(others)):  # the owner sums its segment: its own values exactly, the others' as sent
            total.add_(_dequantize(st.inbox[k], n, flat.dtype))
        total.add_(st.owner_error)
        sent = _quantize(total, chunk[me])
        torch.sub(total, sent, out=st.owner_error)
        ring.all_gather(comm, st.packed, algorithm="int8", step0=1)
        for j, (o, n) in enumerate(segs):
            flat[o:o + n].copy_(_dequantize(chunk[j], n, flat.dtype))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{key}/{n}": t for key, st in self._state.items()
                for n, t in (("error", st.error), ("owner_error", st.owner_error))}

    @staticmethod
    def theory(numel: int, world_size: int) -> tuple[int, int]:
        """``(bytes, messages)`` every rank sends reducing ``numel`` elements: 2(G-1) packed segments."""
        if numel == 0 or world_size == 1:
            return 0, 0
        return 2 * (world_size - 1) * _layout(numel, world_size)[1], 2 * (world_size - 1)


@dataclass
class _Factors:
    offset: int
    rows: int
    cols: int
    p: torch.Tensor      # rows x r: a view of the P all-reduce's buffer
    q: torch.Tensor      # cols x r: a view of the Q all-reduce's buffer, warm-started from the previous step
    error: torch.Tensor  # rows x cols


@dataclass
class _PowerState:
    factors: list[_Factors]
    rest: list[tuple[int, int, int]]  # (offset in the bucket, numel, offset in p) of what is sent as it is
    p: torch.Tensor              # every matrix's P, then the rest: the first all-reduce
    q: torch.Tensor              # every matrix's Q: the second
    calls: int = 0


class PowerSGD(Compressor):
    """PowerSGD (Vogels et al., 2019): each weight matrix M (n x m, this rank's gradient plus its error) is sent
    as rank-``rank`` factors, found by one step of power iteration warm-started from the previous step's Q::

        P = sum over ranks of M Q          (all-reduce, n x r)
        P = orthonormal columns of P       (QR, the same on every rank)
        Q = sum over ranks of M^T P        (all-reduce, m x r)
        sum over ranks of M  ~  P Q^T      (error: M - P Q^T / G, fed back next step)

    Vectors (biases, norms) and matrices too small to gain ((n + m) r >= n m) go uncompressed in the P
    all-reduce. The first ``warmup`` steps of a bucket are reduced exactly (the early gradients move the most).
    Both all-reduces use the data-parallel algorithm (ring, tree, native, ...), so their bytes are counted as
    theirs: (n + m) r elements instead of n m per matrix.
    """

    name = "powersgd"

    def __init__(self, rank: int = 4, warmup: int = 10, seed: int = 0) -> None:
        if rank < 1 or warmup < 0:
            raise ValueError(f"PowerSGD needs rank >= 1 and warmup >= 0, got rank={rank}, warmup={warmup}.")
        self.rank, self.warmup, self.seed = rank, warmup, seed
        self._state: dict[int, _PowerState] = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, st in self._state.items():
            out[f"{key}/calls"], out[f"{key}/q"] = torch.tensor(st.calls, dtype=torch.int64), st.q
            out.update({f"{key}/error{i}": f.error for i, f in enumerate(st.factors)})
        return out

    def split(self, shapes: Shapes, numel: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """``(matrices, rest)``: the ``(offset, rows, cols)`` sent as factors, and the ``(offset, numel)`` sent
        as they are (vectors, matrices too small to gain, a bucket's padding up to ``numel``)."""
        matrices, rest = [], []
        for offset, shape in shapes:
            rows = shape[0] if len(shape) >= 2 else 0
            cols = shape.numel() // rows if rows else 0
            if rows and self.rank < min(rows, cols) and (rows + cols) * self.rank < rows * cols:
                matrices.append((offset, rows, cols))
            else:
                rest.append((offset, shape.numel()))
        end = max((o + s.numel() for o, s in shapes), default=0)
        if numel > end:
            rest.append((end, numel - end))
        return matrices, rest

    def _plan(self, key: int, flat: torch.Tensor, shapes: Shapes) -> _PowerState:
        """The bucket's matrices with their P and Q as views of the two all-reduces' buffers, Q drawn from a
        generator seeded alike on every rank."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        matrices, rest = self.split(shapes, flat.numel())
        r = self.rank
        p = flat.new_empty(sum(rows for _, rows, _ in matrices) * r + sum(n for _, n in rest))
        q = flat.new_empty(sum(cols for _, _, cols in matrices) * r)
        factors, at, qat = [], 0, 0
        for offset, rows, cols in matrices:
            f = _Factors(offset, rows, cols, p[at:at + rows * r].view(rows, r), q[qat:qat + cols * r].view(cols, r),
                         flat.new_zeros(rows, cols))
            f.q.copy_(torch.randn(cols, r, generator=gen, dtype=torch.float64))
            factors.append(f)
            at, qat = at + rows * r, qat + cols * r
        places = [(offset, n, at + sum(m for _, m in rest[:i])) for i, (offset, n) in enumerate(rest)]
        return _PowerState(factors, places, p, q)

    def reduce(self, comm: Communicator, key: int, flat: torch.Tensor, shapes: Shapes, algorithm: str) -> None:
        from fourfold.comm import allreduce

        st = self._state.get(key)
        if st is None:
            st = self._state[key] = self._plan(key, flat, shapes)
            calls = torch.zeros((), dtype=torch.int64)
            if self._restore(key, {"calls": calls, "q": st.q,
                                   **{f"error{i}": f.error for i, f in enumerate(st.factors)}}):
                st.calls = int(calls)
        st.calls += 1
        if st.calls <= self.warmup or not st.factors:
            allreduce(flat, algorithm, comm=comm, check=st.calls == 1)
            return
        matrices = []
        for f in st.factors:  # M = gradient + error; P = M Q
            m = flat[f.offset:f.offset + f.rows * f.cols].view(f.rows, f.cols).add_(f.error)
            torch.mm(m, f.q, out=f.p)
            matrices.append(m)
        for offset, n, at in st.rest:  # vectors and small matrices ride after the P's
            st.p[at:at + n].copy_(flat[offset:offset + n])
        allreduce(st.p, algorithm, comm=comm, check=False)
        orthonormal = []
        for f, m in zip(st.factors, matrices, strict=True):
            p = torch.linalg.qr(f.p).Q
            torch.mm(m.t(), p, out=f.q)
            orthonormal.append(p)
        for offset, n, at in st.rest:
            flat[offset:offset + n].copy_(st.p[at:at + n])
        allreduce(st.q, algorithm, comm=comm, check=False)  # every f.q is now the summed Q
        for f, m, p in zip(st.factors, matrices, orthonormal, strict=True):
            approx = torch.mm(p, f.q.t())
            torch.sub(m, approx, alpha=1.0 / comm.size, out=f.error)  # what this rank's share missed
            m.copy_(approx)

    def theory(self, shapes: Shapes, numel: int) -> int:
        """Elements the two all-reduces carry in all once past the warm-up ((n + m) r per matrix, the rest as it
        is): times the algorithm's cost per element (``2(G-1)/G`` for the ring) it gives the bytes."""
        matrices, rest = self.split(shapes, numel)
        return sum((rows + cols) * self.rank for _, rows, cols in matrices) + sum(n for _, n in rest)


def make_compressor(name: str, *, rank: int = 4, warmup: int = 10) -> Compressor | None:
    """The compressor ``compress=name`` asks for (None for ``none`` and ``bf16``, which is a reduce dtype)."""
    if name not in COMPRESSIONS:
        raise ValueError(f"compress must be one of {', '.join(COMPRESSIONS)}, got {name!r}.")
    if name == "int8":
        return Int8()
    if name == "powersgd":
        return PowerSGD(rank, warmup)
    return None
