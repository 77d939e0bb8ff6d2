"""fourfold.parallel.tensor.layers: sharded layers and TinyGPT over tp ranks equal the unsharded reference.

Spawns are the expensive part, so each is read by many tests (module-level caches):

* ``layers`` (tp = 1, 2, 4, float64): every layer against its unsharded nn.Linear / nn.Embedding /
  F.cross_entropy on the same seeded inputs; the output and each gradient (input, weight, bias) are separate
  tests, each rank's shard against the matching slice of the reference. Also ``tensor_parallel`` on a small user
  model with a tied head, and (tp > 1) the refusals of sizes that do not divide by tp.
* ``train`` (tp = 2, 4): TinyGPT parallelised with and without sequence parallelism trains ``STEPS`` AdamW steps
  on the same batches as one process; float64 must match to 1e-10, float32 (tp = 2) to the tolerance below.
  The same spawn records the step-0 collectives (vs ``collective_theory``) and the parameter bytes per rank.
* ``dp x tp`` (4 ranks): DataParallel around the tensor-parallel TinyGPT on a 2 x 2 mesh, equal to one process.

Reading a failure: a check is named ``<layer>[.<variant>].<quantity>`` with tp, and its message gives the max
|error| over ranks. An output right but ``grad_input`` wrong points at f / g or the sequence gather / scatter
backward; a weight gradient wrong with the input gradient right points at the shard slicing (``from_linear``,
``ShardLayout``). In training, a wrong step-0 loss is a forward bug; right losses with wrong weights a backward one;
with sequence parallelism, only wpe / layer-norm / row-bias weights wrong means ``sync_replicated_grads``.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fourfold.mesh import Mesh
from fourfold.models import GPTConfig, TinyGPT
from fourfold.models.gpt_plan import (
    check_tinygpt_tp,
    collective_theory,
    collectives_per_step,
    parallelize_tinygpt,
)
from fourfold.observe.trace import Tracer
from fourfold.parallel.data import DataParallel
from fourfold.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardLayout,
    VocabParallelEmbedding,
    gather_state_dict,
    load_full_state_dict,
    parameter_bytes,
    shard,
    shard_layouts,
    sync_replicated_grads,
    tensor_parallel,
    unshard,
    vocab_parallel_cross_entropy,
)
from fourfold.parallel.tensor.norm import ShardedRMSNorm
from fourfold.parallel.tensor.regions import shard_regions
from fourfold.testing import run_ranks

F64 = torch.float64
B, T, IN, OUT = 3, 8, 8, 12  # every size divisible by tp = 1, 2, 4
V, C = 16, 8  # vocabulary and width of the embedding / loss checks
CFGS = {
    "tied": GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, d_model=16),
    "untied": GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, d_model=16, tie_weights=False,
                        bias=False),
}
BATCH, STEPS, LR, WEIGHT_DECAY = 4, 3, 1e-2, 0.1
TOL64 = 1e-10
LAYER_TOL = 1e-12  # float64 layers: sums of <= 64 products of O(1) numbers in a different order
# float32, tp = 2: the row-parallel layers add two partial sums instead of one running sum, so gradients differ
# from one process by a few ulps; Adam divides m by sqrt(v) + eps, which makes the update of a parameter whose
# exact gradient is 0 (the key bias: softmax ignores a constant added to every key) pure rounding noise. As in
# test_data_parallel, each tensor's yardstick is how far float32 rounding alone puts one process from float64:
# |tp - one process (float32)| <= 1e-6 + F32_SLACK * max |one process float32 - one process float64|.
F32_SLACK = 4.0
LOSS_TOL32 = 1e-5  # losses ~ln(64) = 4.2: ~20 float32 ulps


def _err(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """max |got - want|; inf when one is missing or the shapes differ (so the test fails and says so)."""
    if got is None or want is None or got.shape != want.shape:
        return float("inf")
    return (got.detach().double() - want.detach().double()).abs().max().item()


def _seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _linear(seed: int, n_in: int, n_out: int, bias: bool = True) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=bias, dtype=F64)
    with torch.no_grad():
        lin.weight.copy_(_seeded(seed, n_out, n_in) / n_in**0.5)
        if bias:
            lin.bias.copy_(_seeded(seed + 1, n_out))
    return lin


# ----------------------------------------------------------------------------------- layers: one spawn per tp


def _check_column(out: dict, rank: int, p: int, label: str, *, parts: int | tuple[int, ...] = 1,
                  gather: bool = False, sp: bool = False, n_out: int = OUT) -> None:
    full = _linear(0, IN, n_out)
    x, gy = _seeded(2, B, T, IN), _seeded(3, B, T, n_out)
    xr = x.clone().requires_grad_()
    yr = full(xr)
    (yr * gy).sum().backward()
    layer = ColumnParallelLinear.from_linear(full, None, parts=parts, gather_output=gather, sequence_parallel=sp)
    seq = ShardLayout(1)  # the sequence shards of sequence parallelism
    xs = (shard(x, seq, rank, p) if sp else x.clone()).requires_grad_()
    y = layer(xs)
    cols = ShardLayout(-1, parts)  # Y_i: this rank's columns of each of the parts
    want_y, my_gy = (yr, gy) if gather else (shard(yr, cols, rank, p), shard(gy, cols, rank, p))
    (y * my_gy).sum().backward()
    out[f"{label}.output"] = _err(y, want_y)
    out[f"{label}.grad_input"] = _err(xs.grad, shard(xr.grad, seq, rank, p) if sp else xr.grad)
    out[f"{label}.grad_weight"] = _err(layer.weight.grad, shard(full.weight.grad, ShardLayout(0, parts), rank, p))
    out[f"{label}.grad_bias"] = _err(layer.bias.grad, shard(full.bias.grad, ShardLayout(0, parts), rank, p))


def _check_row(out: dict, rank: int, p: int, label: str, *, split_input: bool = False, sp: bool = False) -> None:
    full = _linear(4, OUT, IN)
    x, gy = _seeded(6, B, T, OUT), _seeded(7, B, T, IN)
    xr = x.clone().requires_grad_()
    yr = full(xr)
    (yr * gy).sum().backward()
    layer = RowParallelLinear.from_linear(full, None, input_is_parallel=not split_input, sequence_parallel=sp)
    seq, cols = ShardLayout(1), ShardLayout(-1)
    xs = (x.clone() if split_input else shard(x, cols, rank, p)).requires_grad_()
    y = layer(xs)
    (y * (shard(gy, seq, rank, p) if sp else gy)).sum().backward()
    out[f"{label}.output"] = _err(y, shard(yr, seq, rank, p) if sp else yr)
    out[f"{label}.grad_input"] = _err(xs.grad, xr.grad if split_input else shard(xr.grad, cols, rank, p))
    out[f"{label}.grad_weight"] = _err(layer.weight.grad, shard(full.weight.grad, ShardLayout(1), rank, p))
    bias_grad = layer.bias.grad.clone()
    if sp:  # the replicated bias saw only this rank's positions: sum the partial gradients, as
        # sync_replicated_grads does
        dist.all_reduce(bias_grad)
    out[f"{label}.grad_bias"] = _err(bias_grad, full.bias.grad)


def _check_chain(out: dict, rank: int, p: int, label: str, *, sp: bool = False) -> None:
    """Column -> GELU -> row, Megatron's MLP: one forward and one backward collective for the pair."""
    fc, proj = _linear(8, IN, OUT), _linear(10, OUT, IN)
    x, gy = _seeded(12, B, T, IN), _seeded(13, B, T, IN)
    xr = x.clone().requires_grad_()
    yr = proj(F.gelu(fc(xr)))
    (yr * gy).sum().backward()
    col = ColumnParallelLinear.from_linear(fc, None, sequence_parallel=sp)
    row = RowParallelLinear.from_linear(proj, None, sequence_parallel=sp)
    seq = ShardLayout(1)
    xs = (shard(x, seq, rank, p) if sp else x.clone()).requires_grad_()
    y = row(F.gelu(col(xs)))
    (y * (shard(gy, seq, rank, p) if sp else gy)).sum().backward()
    out[f"{label}.output"] = _err(y, shard(yr, seq, rank, p) if sp else yr)
    out[f"{label}.grad_input"] = _err(xs.grad, shard(xr.grad, seq, rank, p) if sp else xr.grad)
    out[f"{label}.grad_weight"] = max(_err(col.weight.grad, shard(fc.weight.grad, ShardLayout(0), rank, p)),
                                      _err(row.weight.grad, shard(proj.weight.grad, ShardLayout(1), rank, p)))
    row_bias = row.bias.grad.clone()
    if sp:
        dist.all_reduce(row_bias)
    out[f"{label}.grad_bias"] = max(_err(col.bias.grad, shard(fc.bias.grad, ShardLayout(0), rank, p)),
                                    _err(row_bias, proj.bias.grad))


class GemmaNorm(nn.Module):
    """An RMSNorm scaling by 1 + weight (Gemma's): not what plan style 'norm' computes, so refused."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(n)), 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class Float32Norm(nn.Module):
    """transformers' RMSNorm arithmetic: in float32 whatever the input's dtype, the weight applied before the cast
    back (OLMo's, T5's) or after it (Llama's)."""

    def __init__(self, n: int, before: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight, self.variance_epsilon, self.before = nn.Parameter(torch.ones(n, dtype=dtype)), 1e-6, before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(x.dtype) if self.before else self.weight * h.to(x.dtype)


def _check_norm(out: dict, rank: int, p: int, label: str, float32: bool = False) -> None:
    """An RMSNorm over features a column layer split (OLMo 2's q/k norms): its mean square over all of them.
    ``float32``: transformers' arithmetic (OLMo's), whose float32 sums the cut adds in another order."""
    full = Float32Norm(OUT, before=True, dtype=F64) if float32 else nn.RMSNorm(OUT, eps=1e-5, dtype=F64)
    with torch.no_grad():
        full.weight.copy_(_seeded(30, OUT))
    x, gy = _seeded(31, B, T, OUT), _seeded(32, B, T, OUT)
    xr = x.clone().requires_grad_()
    yr = full(xr)
    (yr * gy).sum().backward()
    layer = ShardedRMSNorm.from_norm(full, None)
    features = ShardLayout(-1)
    xs = shard(x, features, rank, p).requires_grad_()
    y = layer(xs)
    (y * shard(gy, features, rank, p)).sum().backward()
    out[f"{label}.output"] = _err(y, shard(yr, features, rank, p))
    out[f"{label}.grad_input"] = _err(xs.grad, shard(xr.grad, features, rank, p))
    out[f"{label}.grad_weight"] = _err(layer.weight.grad, shard(full.weight.grad, ShardLayout(0), rank, p))


def _check_embedding(out: dict, rank: int, p: int, label: str, *, sp: bool = False, pad: int | None = None) -> None:
    """``pad``: nn.Embedding's padding_idx (its row gets no gradient), here on the last rank's rows."""
    full = nn.Embedding(V, C, dtype=F64, padding_idx=pad)
    with torch.no_grad():
        full.weight.copy_(_seeded(14, V, C))
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(15))
    if pad is not None:
        idx[:, ::2] = pad  # the padding row is looked up, and must still get no gradient
    gy = _seeded(16, B, T, C)
    yr = full(idx)
    (yr * gy).sum().backward()
    layer = VocabParallelEmbedding.from_embedding(full, None, sequence_parallel=sp)
    y = layer(idx)
    seq = ShardLayout(1)
    (y * (shard(gy, seq, rank, p) if sp else gy)).sum().backward()
    out[f"{label}.output"] = _err(y, shard(yr, seq, rank, p) if sp else yr)
    out[f"{label}.grad_weight"] = _err(layer.weight.grad, shard(full.weight.grad, ShardLayout(0), rank, p))


def _check_cross_entropy(out: dict, rank: int, p: int, label: str, *, scale: float) -> None:
    """``scale`` = 100: logits up to ~400, where a naive exp overflows; row maxima often on other ranks."""
    logits = _seeded(17, B, T, V) * scale
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(18))
    zr = logits.clone().requires_grad_()
    loss_r = F.cross_entropy(zr.reshape(-1, V), targets.reshape(-1))
    (2.5 * loss_r).backward()  # an upstream gradient other than 1
    z = shard(logits, ShardLayout(-1), rank, p).requires_grad_()
    loss = vocab_parallel_cross_entropy(z, targets, None)
    (2.5 * loss).backward()
    out[f"{label}.loss"] = _err(loss, loss_r)
    out[f"{label}.grad_logits"] = _err(z.grad, shard(zr.grad, ShardLayout(-1), rank, p))


class TiedModel(nn.Module):
    """A user's model: embedding, a residual MLP, a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, C, dtype=F64)
        self.fc1, self.fc2 = _linear(19, C, 4 * C), _linear(21, 4 * C, C)
        self.out = nn.Linear(C, V, bias=False, dtype=F64)
        with torch.no_grad():
            self.emb.weight.copy_(_seeded(23, V, C))
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, C)
        x = x + self.fc2(F.gelu(self.fc1(x)))  # (B, T, C)
        return self.out(x)  # (B, T, V), or (B, T, V/p) sharded


PLAN = {"emb": "vocab", "fc1": "column", "fc2": "row", "out": "column"}


def _check_plan(out: dict, rank: int, p: int) -> None:
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(24))
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(25))
    ref = TiedModel()
    loss_r = F.cross_entropy(ref(idx).reshape(-1, V), targets.reshape(-1))
    loss_r.backward()
    model = tensor_parallel(TiedModel(), PLAN, None)
    loss = vocab_parallel_cross_entropy(model(idx), targets, None)
    loss.backward()
    out["plan.loss"] = _err(loss, loss_r)
    out["plan.still_tied"] = 0.0 if model.out.weight is model.emb.weight else float("inf")
    layouts = shard_layouts(model)
    out["plan.grad_weight"] = max(_err(q.grad, shard(dict(ref.named_parameters())[n].grad, layouts[n], rank, p))
                                  for n, q in model.named_parameters())


def _refusals(p: int) -> dict[str, str]:
    """Each bad size at this tp: the message it was refused with, or 'not refused'."""
    odd = 2 * p + 1

    def tied_head_left_out():
        tensor_parallel(TiedModel(), {"emb": "vocab"}, None)

    cases = {
        "column": lambda: ColumnParallelLinear(4, odd, None),
        "column_parts": lambda: ColumnParallelLinear(4, 3 * (p + 1), None, parts=3),
        "column_gqa": lambda: ColumnParallelLinear(4, 4 * (p + 1), None, parts=(2, 1, 1)),
        "row": lambda: RowParallelLinear(odd, 4, None),
        "vocab": lambda: VocabParallelEmbedding(255, 4, None),
        "n_head": lambda: parallelize_tinygpt(TinyGPT(GPTConfig(n_layer=1, n_head=3, d_model=24)), None),
        "vocab_size": lambda: parallelize_tinygpt(TinyGPT(GPTConfig(n_layer=1, vocab_size=255)), None),
        "seq_len": lambda: parallelize_tinygpt(TinyGPT(GPTConfig(n_layer=1, seq_len=2 * p - 1)), None,
                                               sequence_parallel=True),
        "T": lambda: parallelize_tinygpt(TinyGPT(GPTConfig(n_layer=1, seq_len=8)), None, sequence_parallel=True)(
            torch.zeros(1, 2 * p - 1, dtype=torch.long)),
        "targets": lambda: vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.tensor([0, 3 * p]), None),
        "ids": lambda: VocabParallelEmbedding(4 * p, 4, None)(torch.tensor([[0, 4 * p]])),  # one process raises too
        "plan_name": lambda: tensor_parallel(TiedModel(), {"fc9": "column"}, None),
        "plan_type": lambda: tensor_parallel(TiedModel(), {"emb": "column"}, None),
        "plan_style": lambda: tensor_parallel(TiedModel(), {"fc1": "diagonal"}, None),
        "plan_hf_style": lambda: tensor_parallel(TiedModel(), {"fc1": "packed_colwise"}, None),
        "plan_wildcard": lambda: tensor_parallel(TiedModel(), {"layers.*.fc1": "colwise"}, None),
        "plan_tied": tied_head_left_out,
        "norm_features": lambda: ShardedRMSNorm(odd, None, eps=1e-6, arithmetic="input"),
        "norm_gemma": lambda: tensor_parallel(nn.Sequential(GemmaNorm(4 * p)), {"0": "norm"}, None),
        "norm_linear": lambda: tensor_parallel(TiedModel(), {"fc1": "norm"}, None),
        "plan_sizes": lambda: tensor_parallel(nn.Sequential(nn.Linear(4, odd), nn.Linear(odd, 4)),
                                              {"0": "column", "1": "row"}, None),
        "plan_mha": lambda: tensor_parallel(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True),
                                            {"self_attn.out_proj": "row"}, None),
        "plan_linear_subclass": lambda: tensor_parallel(nn.Sequential(DoubledLinear(4, 4 * p)), {"0": "column"}, None),
    }
    out = {}
    for name, make in cases.items():
        try:
            make()
            out[name] = "not refused"
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _layers(ctx) -> dict:
    rank, p = ctx.rank, ctx.world_size
    out: dict = {}
    _check_column(out, rank, p, "column")
    _check_column(out, rank, p, "column.gather", gather=True)
    _check_column(out, rank, p, "column.qkv", parts=3)
    _check_column(out, rank, p, "column.gqa", parts=(2, 1, 1), n_out=16)  # q|k|v, twice the query heads
    _check_column(out, rank, p, "column.sp", sp=True)
    _check_row(out, rank, p, "row")
    _check_row(out, rank, p, "row.split_input", split_input=True)
    _check_row(out, rank, p, "row.sp", sp=True)
    _check_chain(out, rank, p, "chain")
    _check_chain(out, rank, p, "chain.sp", sp=True)
    _check_norm(out, rank, p, "norm")
    _check_norm(out, rank, p, "norm.float32", float32=True)
    _check_embedding(out, rank, p, "embedding")
    _check_embedding(out, rank, p, "embedding.sp", sp=True)
    _check_embedding(out, rank, p, "embedding.pad", pad=V - 1)
    _check_cross_entropy(out, rank, p, "cross_entropy", scale=1.0)
    _check_cross_entropy(out, rank, p, "cross_entropy.large", scale=100.0)
    _check_plan(out, rank, p)
    return {"errors": out, "refusals": _refusals(p) if p > 1 else {}}


@functools.cache
def _layer_results(tp: int) -> dict:
    per_rank = run_ranks(_layers, tp, timeout_s=60)
    errors = {k: max(r["errors"][k] for r in per_rank) for k in per_rank[0]["errors"]}
    return {"errors": errors, "refusals": per_rank[0]["refusals"]}


LAYER_CHECKS = [f"{layer}.{q}" for layer in ("column", "column.gather", "column.qkv", "column.gqa", "column.sp", "row",
                                             "row.split_input", "row.sp", "chain", "chain.sp")
                for q in ("output", "grad_input", "grad_weight", "grad_bias")]
LAYER_CHECKS += [f"{norm}.{q}" for norm in ("norm", "norm.float32") for q in ("output", "grad_input", "grad_weight")]
LAYER_CHECKS += [f"{layer}.{q}" for layer in ("embedding", "embedding.sp", "embedding.pad")
                 for q in ("output", "grad_weight")]
LAYER_CHECKS += [f"{layer}.{q}" for layer in ("cross_entropy", "cross_entropy.large")
                 for q in ("loss", "grad_logits")]
LAYER_CHECKS += ["plan.loss", "plan.still_tied", "plan.grad_weight"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("check", LAYER_CHECKS)
def test_layer_matches_unsharded(tp, check):
    err = _layer_results(tp)["errors"][check]
    tol = 1e-6 if check.startswith("norm.float32") else LAYER_TOL  # float32 sums, added in another order
    assert err <= tol, f"{check} at tp={tp}: max |error| over ranks {err:.3g} > {LAYER_TOL:g}"


REFUSALS = {
    "column": "out_features must be divisible by tp, got {odd} and {p}",
    "column_parts": "out_features must be divisible by tp*3, got {parts3} and {p}",
    "column_gqa": "out_features must be divisible by tp*4 (blocks in proportions 2:1:1), got {gqa} and {p}",
    "row": "in_features must be divisible by tp, got {odd} and {p}",
    "vocab": "vocab_size must be divisible by tp, got 255 and {p}. Pad the vocabulary to 256",
    "n_head": "n_head must be divisible by tp, got n_head=3 and tp={p}. Pass --tp 1 (no tensor parallelism), or "
              "--n-head {heads}",  # whole heads that still divide d_model 24 (and the vocabulary, by tp)
    "vocab_size": "vocab_size must be divisible by tp, got vocab_size=255 and tp={p}. Pass --tp 1 (no tensor "
                  "parallelism), or --vocab-size 256",
    "seq_len": "seq_len must be divisible by tp, got seq_len={seq} and tp={p}. Pass --tp 1 (no tensor "
               "parallelism), or --seq-len {seq_up}",
    "T": "sequence length must be divisible by tp with sequence parallelism, got T={seq} and tp={p}",
    "targets": "targets must be token ids in [0, {vocab})",
    "ids": "the embedding's ids must be in [0, {ids}), got ids in [0, {ids}]",
    "plan_name": "plan names a module the model does not have, got 'fc9'",
    "plan_type": "TypeError: plan style 'column' shards an nn.Linear (or a GPT-2 Conv1D), got 'emb': Embedding",
    "plan_style": "plan style for 'fc1' must be one of column, column:<parts>, row, vocab, head",
    "plan_hf_style": "(or Hugging Face's colwise, rowwise, embedding_rowwise, colwise_gather_output, colwise_rep, "
                     "replicate, replicated_with_grad_allreduce), got 'packed_colwise'. Shard that module with one "
                     "of these, or leave it out",
    "plan_wildcard": "plan names a module the model does not have, got 'layers.*.fc1'. Linear and Embedding "
                     "modules: emb, fc1, fc2, out",
    "plan_tied": "'out.weight' is tied to 'emb', which the plan shards",
    "norm_features": "the norm's features must be divisible by tp, got {odd} and {p}",
    "norm_gemma": "plan style 'norm' computes an RMSNorm, x / sqrt(mean(x^2) + eps) * weight, got a GemmaNorm that "
                  "computes otherwise on a test input. Gather its input whole instead",
    "norm_linear": "plan style 'norm' shards an RMSNorm's 1-D weight, got Linear with weight (",
    "plan_sizes": "plan entry '0' (column): out_features must be divisible by tp, got {odd} and {p}",
    "plan_mha": "plan style 'row' cannot shard 'self_attn.out_proj': nn.MultiheadAttention (nn.TransformerEncoderLayer's "
                "too) computes with its weights directly",
    "plan_linear_subclass": "plan style 'column' cannot shard '0': DoubledLinear subclasses nn.Linear, but its forward "
                            "does not compute x @ W.T + b (checked on a random input)",
}


class DoubledLinear(nn.Linear):
    """A subclass of nn.Linear whose forward computes something else (a LoRA-style scale, say)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class FalconLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.weight.T
        return h if self.bias is None else h + self.bias


def test_a_subclass_of_linear_is_split_when_its_forward_computes_a_linear_layer():
    """Falcon's FalconLinear and torchtitan's projections subclass nn.Linear: split as nn.Linear where their forward
    computes x @ W.T + b on a random input (float64, float32, bfloat16, no bias); refused where it computes more;
    on the meta device (the preflight) taken by type, checked again on the ranks. The run's random stream is
    untouched by the check."""
    from fourfold.parallel.tensor.layers import computes_linear

    linear = [nn.Linear(4, 8), nn.modules.linear.NonDynamicallyQuantizableLinear(4, 8), FalconLinear(4, 8, bias=False),
              *(FalconLinear(4, 8, dtype=dtype) for dtype in (torch.float64, torch.float32, torch.bfloat16))]
    other = [DoubledLinear(4, 8), nn.Embedding(4, 8)]
    with torch.device("meta"):
        meta = DoubledLinear(4, 8)
    state = torch.get_rng_state()
    assert [computes_linear(m) for m in linear] == [True] * len(linear)
    assert [computes_linear(m) for m in other] == [False, False]
    assert computes_linear(meta)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_sizes_refused_by_name(tp, case):
    want = REFUSALS[case].format(p=tp, odd=2 * tp + 1, parts3=3 * (tp + 1), gqa=4 * (tp + 1), seq=2 * tp - 1,
                                 vocab=3 * tp, ids=4 * tp,
                                 heads={2: 4, 4: 4}[tp], seq_up=2 * tp)
    got = _layer_results(tp)["refusals"][case]
    assert want in got, f"tp={tp} {case}: want a message containing {want!r}, got {got!r}"


class ScaledNorm(nn.RMSNorm):
    """torch's RMSNorm with a constant buffer it multiplies by: the probe must keep the buffer's values."""

    def __init__(self, n: int) -> None:
        super().__init__(n, eps=1e-6)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def test_a_sharded_norm_computes_as_the_norm_it_replaces():
    """numerics() finds each RMSNorm's arithmetic by running it: the input's dtype (nn.RMSNorm, eps None resolved
    at run time as torch does), float32 with the weight applied after the cast back (Llama's) or before it
    (OLMo's), told apart in bfloat16, where only the right one matches bit for bit; a buffer of the module is kept,
    a meta module works, and a Gemma norm (1 + weight) is refused."""
    from fourfold.parallel.tensor.norm import numerics

    assert numerics(nn.RMSNorm(8)) == (None, "input")  # float32 weights: eps is the input's, not float64's
    assert numerics(nn.RMSNorm(8, eps=1e-5, dtype=torch.bfloat16)) == (1e-5, "input")
    assert numerics(Float32Norm(8, before=False)) == (1e-6, "float32, weight after the cast")
    assert numerics(Float32Norm(8, before=True, dtype=torch.bfloat16)) == (1e-6, "float32, weight before the cast")
    assert numerics(ScaledNorm(8)) == (1e-6, "input")
    with torch.device("meta"):
        meta = Float32Norm(8, before=True)
    assert numerics(meta)[1] == "float32, weight before the cast"
    with pytest.raises(ValueError, match="got a GemmaNorm that computes otherwise"):
        numerics(GemmaNorm(8))


def test_fused_blocks_of_unequal_widths_each_split_by_rank():
    """q|k|v of grouped-query attention, 8 + 4 + 4 rows: each rank takes its slice of each block, by hand."""
    from fourfold.parallel.tensor.plan import _parse_style

    full = torch.arange(16.0).unsqueeze(1)
    layout = ShardLayout(0, (2, 1, 1))
    rows = {0: [0, 1, 2, 3, 8, 9, 12, 13], 1: [4, 5, 6, 7, 10, 11, 14, 15]}
    pieces = [shard(full, layout, r, 2) for r in (0, 1)]
    assert [p.squeeze(1).tolist() for p in pieces] == [[float(i) for i in rows[r]] for r in (0, 1)]
    assert torch.equal(unshard(pieces, layout), full)
    assert _parse_style("qkv", "column:32,8,8") == ("column", (4, 1, 1))  # lowest terms, any unit
    assert _parse_style("qkv", "column:8,8,8") == ("column", 3)  # equal widths: a count
    with pytest.raises(ValueError, match="must be one of column, column:<parts>"):
        _parse_style("qkv", "column:32,0")


# --------------------------------------------------------------------- TinyGPT training: one spawn per tp


def _batches(cfg: GPTConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=g) for _ in range(STEPS)]
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


@functools.cache
def _reference(cfg_name: str, dtype_name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, STEPS AdamW steps: (losses, final state dict). The golden run."""
    cfg = CFGS[cfg_name]
    model = TinyGPT(cfg, seed=0, dtype=getattr(torch, dtype_name))
    opt = _optimizer(model)
    losses = []
    for x, y in _batches(cfg):
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _part(site: str) -> str:
    """'blocks.1.mlp.fc' -> 'block1'; 'embed.wte' -> 'embed'; 'head.lm_head' -> 'head'; 'loss'; 'grad_sync'."""
    first, _, rest = site.partition(".")
    return f"block{rest.partition('.')[0]}" if first == "blocks" else first


def _train(ctx, variants: list[tuple[str, str, bool]]) -> dict:
    rank = ctx.rank
    out = {}
    for cfg_name, dtype_name, sp in variants:
        cfg, dtype = CFGS[cfg_name], getattr(torch, dtype_name)
        tracer = Tracer(rank)
        model = parallelize_tinygpt(TinyGPT(cfg, seed=0, dtype=dtype), None, sequence_parallel=sp, tracer=tracer)
        opt = _optimizer(model)
        losses, step0 = [], []
        for step, (x, y) in enumerate(_batches(cfg)):
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            sync_replicated_grads(model, None, tracer=tracer)
            opt.step()
            losses.append(loss.item())
            if step == 0:
                step0 = [(_part(s.args["site"]), s.args["phase"], s.name.removeprefix("tp."), s.bytes)
                         for s in tracer.spans]
        full = gather_state_dict(model, None)
        again = parallelize_tinygpt(TinyGPT(cfg, seed=7, dtype=dtype), None, sequence_parallel=sp)
        load_full_state_dict(again, full, None)
        reloaded = max(_err(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values(),
                                                   strict=True))
        layouts = shard_layouts(model)
        one = TinyGPT(cfg, seed=0, dtype=dtype)
        full_sharded = sum(q.numel() * q.element_size() for n, q in one.named_parameters()
                           if layouts[n].dim is not None)
        full_replicated = sum(q.numel() * q.element_size() for n, q in one.named_parameters()
                              if layouts[n].dim is None)
        out[(cfg_name, dtype_name, sp)] = {
            "losses": losses, "state": full if rank == 0 else None, "spans": step0, "reloaded": reloaded,
            "bytes": parameter_bytes(model), "full_bytes": (full_sharded, full_replicated),
            "partial": model.partial_grad_names,
        }
    return out


VARIANTS = {2: [("tied", "float64", False), ("tied", "float64", True), ("untied", "float64", True),
                ("tied", "float32", False), ("tied", "float32", True)],
            4: [("tied", "float64", False), ("tied", "float64", True)]}
CASES = [(tp, *v) for tp, vs in VARIANTS.items() for v in vs]


def _case_id(case) -> str:
    tp, cfg_name, dtype_name, sp = case
    return f"tp{tp}-{cfg_name}-{dtype_name}-{'sp' if sp else 'nosp'}"


@functools.cache
def _trained(tp: int) -> list[dict]:
    return run_ranks(_train, tp, VARIANTS[tp], timeout_s=90)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_tinygpt_trains_like_one_process(case):
    tp, cfg_name, dtype_name, sp = case
    per_rank = [r[(cfg_name, dtype_name, sp)] for r in _trained(tp)]
    want_losses, want = _reference(cfg_name, dtype_name)
    got = per_rank[0]["state"]
    if dtype_name == "float64":
        loss_tol, tol = TOL64, dict.fromkeys(want, TOL64)
    else:
        exact = _reference(cfg_name, "float64")[1]
        loss_tol = LOSS_TOL32
        tol = {k: 1e-6 + F32_SLACK * _err(want[k], exact[k]) for k in want}
    label = _case_id(case)
    for r, res in enumerate(per_rank):
        errs = [abs(a - b) for a, b in zip(res["losses"], want_losses, strict=True)]
        assert max(errs) <= loss_tol, f"{label} rank {r}: losses {res['losses']} vs one process {want_losses}"
    assert list(got) == list(want), f"{label}: gathered state dict keys differ: {list(got)} vs {list(want)}"
    bad = {k: f"{_err(got[k], want[k]):.3g} > {tol[k]:.3g}" for k in want if not _err(got[k], want[k]) <= tol[k]}
    assert not bad, f"{label}: final weights off one process (max |error| per tensor): {bad}"
    assert max(r["reloaded"] for r in per_rank) == 0.0, f"{label}: load_full_state_dict(gather_state_dict) " \
                                                         "does not give back the shards"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "float64"], ids=_case_id)
def test_collectives_per_block_equal_theory(case):
    """Step 0's collectives, per part and per block, against ``collective_theory``; and their payloads."""
    tp, cfg_name, dtype_name, sp = case
    cfg = CFGS[cfg_name]
    theory = collective_theory(sp)
    for r, res in enumerate(_trained(tp)):
        spans = res[(cfg_name, dtype_name, sp)]["spans"]
        counted: dict[str, Counter] = {}
        for part, phase, op, _ in spans:
            counted.setdefault(part, Counter())[(phase, op)] += 1
        per_part = {("block" if part.startswith("block") else part): dict(c) for part, c in counted.items()}
        blocks = [part for part in counted if part.startswith("block")]
        assert sorted(blocks) == [f"block{i}" for i in range(cfg.n_layer)], f"rank {r}: block sites {blocks}"
        for part in blocks:
            assert dict(counted[part]) == theory["block"], f"rank {r} {part} sp={sp}: {dict(counted[part])}"
        assert per_part == theory, f"rank {r} sp={sp}: collectives per part {per_part}, theory {theory}"
        # Payload per block collective: the (B, T, C) activation; an all-gather hands in its (B, T/p, C) shard.
        itemsize = torch.finfo(getattr(torch, dtype_name)).bits // 8
        full = BATCH * cfg.seq_len * cfg.d_model * itemsize
        for part, phase, op, nbytes in spans:
            if part.startswith("block"):
                assert nbytes == (full // tp if op == "all_gather" else full), (r, part, phase, op, nbytes)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("tp", [2, 4])
def test_parameter_bytes_per_rank(tp):
    """Sharded weights hold 1/tp of the full ones on each rank; replicated ones are whole."""
    for res in _trained(tp):
        r = res[("tied", "float64", True)]
        (full_sharded, full_replicated), got = r["full_bytes"], r["bytes"]
        assert got.sharded * tp == full_sharded, (got, full_sharded)
        assert got.replicated == full_replicated, (got, full_replicated)
        assert full_sharded > 0.8 * (full_sharded + full_replicated)  # most weights are the split ones
        # and with sequence parallelism every replicated parameter is one whose gradient needs summing
        assert len(r["partial"]) == 1 + 6 * CFGS["tied"].n_layer + 2, r["partial"]


def _train_dp_tp(ctx, sp: bool) -> dict:
    """dp = 2 x tp = 2: DataParallel (native, buckets overlapped with backward) around the tensor-parallel model."""
    ranks = Mesh.for_world(ctx.world_size, dp=2, tp=2).build()
    tp_group, dp_group = ranks.group("tp"), ranks.group("dp")
    cfg = CFGS["tied"]
    model = parallelize_tinygpt(TinyGPT(cfg, seed=0, dtype=F64), tp_group, sequence_parallel=sp)
    dp = DataParallel(model, dp_group, "native")
    opt = _optimizer(model)
    rows = slice(ranks.coord.dp * BATCH // 2, (ranks.coord.dp + 1) * BATCH // 2)  # this dp rank's half
    losses = []
    for x, y in _batches(cfg):
        opt.zero_grad(set_to_none=True)
        _, loss = dp(x[rows], y[rows])
        loss.backward()
        dp.finish()
        sync_replicated_grads(model, tp_group)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        losses.append(mean.item() / 2)
    return {"losses": losses, "state": gather_state_dict(model, tp_group)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_dp2_tp2_trains_like_one_process(sp):
    want_losses, want = _reference("tied", "float64")
    for r, res in enumerate(run_ranks(_train_dp_tp, 4, sp, timeout_s=90)):
        assert max(abs(a - b) for a, b in zip(res["losses"], want_losses, strict=True)) <= TOL64, (
            f"rank {r}: losses {res['losses']} vs one process {want_losses}")
        bad = {k: _err(res["state"][k], want[k]) for k in want if not _err(res["state"][k], want[k]) <= TOL64}
        assert not bad, f"rank {r} sp={sp}: final weights off one process (max |error|): {bad}"


@pytest.mark.timeout(10)
def test_collective_theory_totals():
    """No processes: a block's halves (Megatron, Shoeybi et al. 2019 sec. 3; Korthikanti et al. 2022 sec. 4.2.2)."""
    plain, sp = collective_theory(False), collective_theory(True)
    assert plain["block"] == {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 2}
    assert sum(plain["block"].values()) * 2 == sum(sp["block"].values())  # each all-reduce cut into RS + AG
    assert {op for _, op in sp["block"]} == {"all_gather", "reduce_scatter"}
    n_layer = 5
    assert collectives_per_step(n_layer, False) == {("forward", "all_reduce"): 2 * n_layer + 3,
                                                    ("backward", "all_reduce"): 2 * n_layer + 1}
    assert collectives_per_step(n_layer, True) == {
        ("forward", "all_gather"): 2 * n_layer + 1, ("forward", "reduce_scatter"): 2 * n_layer + 1,
        ("backward", "all_gather"): 2 * n_layer + 1, ("backward", "reduce_scatter"): 2 * n_layer + 1,
        ("forward", "all_reduce"): 2, ("grad_sync", "all_reduce"): 1}


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("config", "tp", "sp", "want"), [
    (GPTConfig(n_head=6, d_model=96), 4, False, "n_head must be divisible by tp, got n_head=6 and tp=4. Pass --tp 2, "
                                                "or --n-head 8."),
    (GPTConfig(vocab_size=255), 2, False, "vocab_size must be divisible by tp, got vocab_size=255 and tp=2. Pass --tp "
                                          "1 (no tensor parallelism), or --vocab-size 256."),
    (GPTConfig(seq_len=30), 4, True, "seq_len must be divisible by tp, got seq_len=30 and tp=4. Pass --tp 2, or "
                                     "--seq-len 32."),
    (GPTConfig(seq_len=30), 4, False, None),
])
def test_check_tinygpt_tp_before_any_process(config, tp, sp, want):
    if want is None:
        check_tinygpt_tp(config, tp, sequence_parallel=sp)
        return
    with pytest.raises(ValueError, match=re.escape(want)):
        check_tinygpt_tp(config, tp, sequence_parallel=sp)


@pytest.mark.parametrize("shape,tp", [({"d_model": 32, "n_head": 4}, 3), ({"d_model": 32, "n_head": 2}, 3),
                                      ({"d_model": 30, "n_head": 3, "vocab_size": 257}, 2),
                                      ({"d_model": 128, "n_head": 4, "seq_len": 63}, 2),
                                      ({"d_model": 32, "n_head": 4}, 8)])
def test_a_refused_shapes_suggested_flags_pass_every_check(shape, tp):
    from dataclasses import replace

    from fourfold.models.gpt_plan import check_tinygpt_tp

    config = GPTConfig(**shape)
    with pytest.raises(ValueError) as e:
        check_tinygpt_tp(config, tp, sequence_parallel=True)
    words = str(e.value).rsplit(", or ", 1)[1].rstrip(".").split()  # "--n-head 6 --d-model 36 ..."
    fixed = replace(config, **{f[2:].replace("-", "_"): int(v) for f, v in zip(words[::2], words[1::2], strict=True)})
    check_tinygpt_tp(fixed, tp, sequence_parallel=True)  # GPTConfig's own rule (d_model % n_head) held too


def test_a_refused_tp_suggests_only_tp_sizes_the_launch_can_make():
    from fourfold.models.gpt_plan import check_tinygpt_tp

    with pytest.raises(ValueError, match=r"tp=3\. Pass --tp 2, or"):  # --nproc 6: groups of 2 fit
        check_tinygpt_tp(GPTConfig(d_model=32, n_head=4), 3, within=6)
    with pytest.raises(ValueError, match=r"tp=3\. Pass --tp 1 \(no tensor parallelism\), or"):  # --nproc 3
        check_tinygpt_tp(GPTConfig(d_model=32, n_head=4), 3, within=3)


class _OwnHeads(nn.Module):
    """OPT's attention: q, k and v viewed by the model's own head count, not the weights' rows, so a column
    split gives each rank 2 heads' worth of features viewed as 4 narrower heads: another function."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.heads: int | None = 4  # None: heads of 4 features, as many as the (split) weights hold

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        b, t, _ = h.shape
        shape = (b, t, self.heads, -1) if self.heads else (b, t, -1, 4)
        q, k, v = (f(h).view(shape).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(h + self.o(a.transpose(1, 2).reshape(b, t, -1)))


def _misplaced_heads(ctx) -> list[str]:
    """A user's plan whose logits do not reach the loss as the loss reads them: each refused, the first as the
    engine is built (on the example), the second in the first step."""
    from fourfold import parallelize

    ranks = Mesh(tp=2).build(30)
    got = []
    # "column" on the output layer: each rank's logits are half the vocabulary, and the loss (which reads whole
    # logits) would train each rank on its half; "head" on an inner layer: the vocabulary-parallel loss reads
    # logits that are whole
    x = torch.randint(0, 64, (2, 8))
    y = torch.randint(0, 32, (2, 8))  # ids of the first half only, as ASCII text's bytes are under 128 of 256
    for plan in ({"1": "column", "3": "row", "4": "column"}, {"1": "head", "3": "row"}):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16),
                              nn.Linear(16, 64)).double()
        try:
            parallelize(model, ranks, plan=plan, example=x[:1]).step(x, y)
            got.append("trained")
        except ValueError as e:
            got.append(str(e))
    # a plan that changes the function: refused as the engine is built, on the example, against the whole model
    llama_style = {"q": "column", "k": "column", "v": "column", "o": "row"}
    for heads in (4, None):  # 4: viewed by its own count (refused); None: by the weights' rows (exact)
        torch.manual_seed(0)
        model = _OwnHeads().double()
        model.heads = heads
        try:
            parallelize(model, ranks, plan=llama_style, example=x[:1])
            got.append("parallelized")
        except ValueError as e:
            got.append(str(e))
    return got


class _Block(nn.Module):
    """A block whose MLP is a module of its own (``mlp``), or, ``flat``, whose linear layers are the block's own."""

    def __init__(self, flat: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        if flat:
            self.fc, self.act, self.proj = mlp
        else:
            self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + (self.proj(self.act(self.fc(h))) if hasattr(self, "fc") else self.mlp(h))


def _sequence_refusals(group) -> list[str]:
    """shard_regions under sequence parallelism on models it cannot run: blocks that are no list, linear layers directly in a block, a row
    layer whose module gathers nothing."""
    got = []
    cases = [(nn.ModuleDict({"blocks": nn.Sequential(_Block()), "norm": nn.LayerNorm(16)}), {"blocks.0.mlp.0": "column",
              "blocks.0.mlp.2": "row"}),
             (nn.ModuleDict({"blocks": nn.ModuleList([_Block(flat=True)]), "norm": nn.LayerNorm(16)}),
              {"blocks.0.fc": "column", "blocks.0.proj": "row"}),
             (nn.ModuleDict({"blocks": nn.ModuleList([_Block()]), "norm": nn.LayerNorm(16)}),
              {"blocks.0.mlp.2": "row"})]
    for model, plan in cases:
        tensor_parallel(model.double(), plan, group)
        try:
            shard_regions(model, group, blocks="blocks", norm="norm", sequence_parallel=True)
            got.append("sharded")
        except ValueError as e:
            got.append(str(e))
    return got


def _refused_plans(ctx) -> tuple[list[str], list[str]]:
    return _misplaced_heads(ctx), _sequence_refusals(Mesh(tp=2).build(30).tp_group)


@functools.cache
def _refused() -> list[tuple[list[str], list[str]]]:
    return run_ranks(_refused_plans, 2, timeout_s=90)


@pytest.mark.timeout(120)
def test_sequence_parallelism_around_blocks_it_cannot_run_is_refused_naming_the_module():
    for _, (no_list, flat, lone_row) in _refused():
        assert "got 'blocks': Sequential. Name the nn.ModuleList of its blocks" in no_list, no_list
        assert "got blocks.0.fc directly in the block blocks.0" in flat, flat
        assert "got blocks.0.mlp.2 with no column layer beside it" in lone_row, lone_row


@pytest.mark.timeout(120)
def test_a_plan_whose_logits_reach_the_loss_split_or_whole_by_mistake_is_refused():
    for messages, _ in _refused():
        split, whole, own_heads, by_rows = messages
        assert own_heads.startswith("the tensor plan changes what the model computes: on one example its sharded "
                                    "logits differ from the whole model's by"), own_heads
        assert "over tp=2; the first module whose output differs: 'o'" in own_heads, own_heads
        assert "OPT's num_heads" in own_heads, own_heads
        assert by_rows == "parallelized", by_rows  # heads counted from the weights: the split keeps the function
        assert "the tensor-parallel ranks of one replica compute different logits (shape (1, 8, 32)" in split, split
        assert "Mark that layer 'head'" in split
        assert "the loss reads logits 64 wide, but the plan's 'head' layers make '1' (16 wide per rank)" in whole, whole
