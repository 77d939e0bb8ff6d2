"""Your model through every strategy, with no model-specific code per layout: an ``nn.Sequential`` MLP, one
that applies one block three times (ALBERT's shared weights: under pp its copies on each stage are summed as a tied
weight's) and Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Granite, Phi-3, OLMo 2, OLMo 3 and
SmolLM3 (tiny configs, float64, 3 AdamW steps), and GPT-2 with eager attention, also under sequence parallelism (each
family at tp2; four across a pipeline and beside dp), each equal to the same model trained in one process: the losses and every parameter, by the model's own names, to 1e-9 (the parameters of the Gemmas and the
OLMos, whose norms compute in float32, to 1e-6; an OLMo at tp, whose sharded q/k norms add float32 halves, to 1e-7
in its losses and 3e-5 in its parameters).

Spawns are the expensive part (each rank imports transformers), so one spawn per world size runs every model
and layout (module-level caches). Reading a failure: labels are ``model layout``. Wrong only under pp points
at the split (fourfold.models.hf's pieces); only under tp at the plan (GPT-2's Conv1D and fused q|k|v, Llama's
key/value heads) or the split-logits loss.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from torch import nn

from fourfold import Layout, Mesh, parallelize
from fourfold.loss import lm_loss
from fourfold.models import GPTConfig
from fourfold.models.hf import FLOAT32_NORMS
from fourfold.models.hf_plan import QK_NORMS_OVER_HEADS
from fourfold.observe.trace import Tracer
from fourfold.parallel.pipeline.blocks import output_tensor
from fourfold.testing import run_ranks
from helpers import batches, max_error, optimizer, shard

pytest.importorskip("transformers")

DATA = GPTConfig(vocab_size=64, seq_len=8)  # the token batches every model trains on
TOL = 1e-9
# Gemma's RMSNorm computes in float32 whatever the model's dtype (x.float(), then 1 + weight.float()), so its
# weights' gradients are float32 sums, which a batch cut otherwise rounds otherwise: about 5e-8 after 3 steps.
# OLMo's too; and at tp its q/k norms' mean square is two float32 halves added, not one float32 mean, so its
# forward differs by float32's rounding as well: losses 1.3e-8 apart at tp2, weights 8.8e-6 after 3 AdamW steps
# (with its norms patched to compute in float64: 9e-16 and 8e-14; the sharded norm alone is checked to 1e-12 at
# tp 1, 2 and 4 in test_tensor_parallel.py)
TOL_FLOAT32_NORMS = 1e-6
TOL_FLOAT32_FORWARD = 3e-5  # weights; losses 1e-7
MICRO = 2
GPT2 = dict(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)
LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16)
# a window shorter than the sequences (8): the model's own forward applies it, and so must the pipeline's pieces
MISTRAL = {**LLAMA, "sliding_window": 4}  # on every layer
QWEN2 = {**LLAMA, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}  # on layer 1 only; and
# its q/k/v have biases: column-parallel with their weights
QWEN3 = {**LLAMA, "head_dim": 4}  # per-head q/k norms: whole on every rank, their gradients summed over tp
# its embedding scaled by sqrt(hidden_size), its norms by (1 + weight), its head tied to the embedding
GEMMA = {**LLAMA, "head_dim": 4}
# q|k|v fused in one projection (4 query heads, 2 key/value heads: blocks 2:1:1), gate|up in another; a window on
# every layer; rotary on half of each head (Phi-4-mini's partial_rotary_factor)
PHI3 = {**LLAMA, "sliding_window": 4, "partial_rotary_factor": 0.5}
# Gemma 3: Gemma's embedding and norms, Qwen3's q/k norms, a window on its sliding layers only, whose rotary
# frequencies differ from its full layers', four norms a layer, and its logits soft-capped (a cap small enough to
# matter at this size: a pipeline's last piece must cap them as the model's forward does)
GEMMA3 = {**LLAMA, "head_dim": 4, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
          "query_pre_attn_scalar": 4, "final_logit_softcapping": 5.0}
# Gemma 2: Gemma 3 without q/k norms, one rotary frequency; its attention scores soft-capped, which only eager
# attention computes: fourfold's masks are given to it as it reads them (added to the scores), in every piece
GEMMA2 = {**LLAMA, "head_dim": 4, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
          "query_pre_attn_scalar": 4, "final_logit_softcapping": 5.0, "attn_logit_softcapping": 50.0}
# Granite: Llama with multipliers; the embedding's and the logits' divisor are its model's forward's, outside the
# layers, so a pipeline's first and last pieces must apply them (values far from 1, so that they matter)
GRANITE = {**LLAMA, "embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22,
           "attention_multiplier": 0.0078125}
# OLMo 2: norms after attention and the MLP, q/k norms over all heads at once (at tp2 each rank holds half of each
# norm's features: the mean square is summed over the ranks); OLMo 3 adds a window on its sliding layers, whose
# rotary frequencies are their own
OLMO2 = dict(LLAMA)
OLMO3 = {**LLAMA, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}}
# SmolLM3: no rotary embedding on layer 1 (NoPE), and a window there (its sliding layers are its NoPE ones)
SMOLLM3 = {**LLAMA, "no_rope_layers": [1, 0], "use_sliding_window": True, "sliding_window": 4, "pad_token_id": None,
           "bos_token_id": None, "eos_token_id": None}
CONFIGS = {"gpt2": GPT2, "llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3, "gemma": GEMMA,
           "gemma2": GEMMA2, "gemma3_text": GEMMA3, "granite": GRANITE, "phi3": PHI3, "olmo2": OLMO2, "olmo3": OLMO3,
           "smollm3": SMOLLM3}
# GPT-2 again with eager attention, which applies no causal mask of its own: every piece must give it one
MODELS = ("mlp", "shared", *CONFIGS, "gpt2-eager")
OWN = ("mlp", "shared")  # plans of your own: no blocks to find, no sequence parallelism
# label -> (dp, tp, pp, options)
LAYOUTS_2 = {"dp2 ring": (2, 1, 1, {"allreduce": "ring"}), "tp2": (1, 2, 1, {}),
             "pp2 1f1b": (1, 1, 2, {"schedule": "1f1b"}), "pp2 zb": (1, 1, 2, {"schedule": "zb"}),
             "model parallel": (1, 1, 2, {"strategy": "model"})}
LAYOUTS_4 = {"dp2 x tp2": (2, 2, 1, {}), "tp2 x pp2": (1, 2, 2, {"schedule": "1f1b"})}
# sequence parallelism: every family at tp2 (the MLP, a {module: style} mapping with no blocks, is refused it), and
# across a pipeline and beside dp for the families whose blocks differ most: GPT-2's Conv1D, Phi-3's fused
# projections, Gemma 3's four norms a layer and capped logits, OLMo 3's q/k norms sharded with the heads
SP = {"sequence_parallel": True}
LAYOUTS_SP = {2: {"tp2 sp": (1, 2, 1, SP)},
              4: {"tp2 x pp2 sp": (1, 2, 2, {"schedule": "1f1b", **SP}), "dp2 x tp2 sp": (2, 2, 1, SP)}}
MODELS_SP = {2: [m for m in MODELS if m not in OWN], 4: ["gpt2", "phi3", "gemma3_text", "olmo3"]}
# one model more in one layout more: OLMo 2's sharded q/k norms all-reduce in backward, which zero-bubble splits
# into B (input gradients: the norms' all-reduces run there) and W (weight gradients)
# with sequence parallelism too, where W must not all-gather again what B gathered (a row layer's output gradient)
EXTRA = {2: [], 4: [("olmo2", "tp2 x pp2 zb", (1, 2, 2, {"schedule": "zb"})),
                    ("olmo2", "tp2 x pp2 sp", (1, 2, 2, {"schedule": "1f1b", **SP})),
                    ("olmo2", "tp2 x pp2 zb sp", (1, 2, 2, {"schedule": "zb", **SP})),
                    *((m, label, layout) for m in MODELS_SP[4] for label, layout in LAYOUTS_SP[4].items())]}
EXTRA[2] += [(m, label, layout) for m in MODELS_SP[2] for label, layout in LAYOUTS_SP[2].items()]
# every block checkpointed: its recompute gathers the sequence again, in backward, on both ranks alike
EXTRA[2] += [("gemma3_text", "tp2 sp checkpointed", (1, 2, 1, {"activation_checkpointing": "full", **SP}))]


class _Residual(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(h)))


class FalconLinear(nn.Linear):
    """Falcon's: nn.Linear with a forward of its own that computes the same (x @ W.T, then + b)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.weight.T
        return h if self.bias is None else h + self.bias


def build(name: str) -> nn.Module:
    """The same model on every rank (seeded), in float64. The MLP's column layer is a subclass of nn.Linear with
    its own forward (Falcon's), split as nn.Linear is since it computes the same."""
    if name == "mlp":
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(64, 16), FalconLinear(16, 32), nn.GELU(), nn.Linear(32, 16),
                             nn.Linear(16, 64)).double()
    if name == "shared":  # one block at three positions: a pipeline cuts between them
        torch.manual_seed(0)
        block = _Residual(16)
        model = nn.Sequential(nn.Embedding(64, 16), block, block, block, nn.Linear(16, 64)).double()
        model.fourfold_tp_plan = {"1.fc1": "column", "1.fc2": "row"}  # the one module, at every position
        return model
    from fourfold.models.hf import build_hf

    if name == "gpt2-eager":
        model = build_hf("gpt2", overrides=GPT2, dtype=torch.float64)
        model.set_attn_implementation("eager")
        return model
    return build_hf(name, overrides=CONFIGS[name], dtype=torch.float64)


def _train(ctx, name: str, label: str, dp: int, tp: int, pp: int, options: dict) -> dict:
    tracer = Tracer(ctx.rank)
    ranks = Mesh.for_world(ctx.world_size, dp=dp, tp=tp, pp=pp).build(30, tracer)
    engine = parallelize(build(name), ranks, Layout(dp=dp, tp=tp, pp=pp, microbatches=MICRO, **options))
    opt = optimizer(engine.parameters())
    losses = []
    for x, y in batches(DATA):
        loss = engine.step(shard(x, ranks.coord.dp, dp), shard(y, ranks.coord.dp, dp))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    state = engine.state_dict()
    held = engine.counters()["parameter_bytes"]
    ops = collections.Counter((s.args.get("phase"), s.name) for s in tracer.spans if s.name.startswith("tp."))
    sends = [s.bytes for s in tracer.spans if s.name == "send"]
    backward = {s.args.get("site") for s in tracer.spans if s.name == "tp.all_reduce" and s.args.get("phase") == "backward"}
    return {"label": f"{name} {label}", "losses": losses, "state": state if ctx.rank == 0 else None,
            "sharded": held["sharded"], "held": held["total"], "tp": tp, "pp": pp, "ops": ops,
            "sent": max(sends, default=0), "backward": backward,
            "sp": bool(options.get("sequence_parallel"))}


def _all(ctx, layouts: dict) -> list[dict]:
    return [*(_train(ctx, name, label, *layout) for name in MODELS for label, layout in layouts.items()),
            *(_train(ctx, name, label, *layout) for name, label, layout in EXTRA[ctx.world_size]),
            {"label": "refused", "messages": _refused(ctx) if ctx.world_size == 2 else []}]


def _refused(ctx) -> list[str]:
    """A family's model with a plan of yours (here the MLP's only) under sequence parallelism: refused, as any
    {module: style} plan is, where the family's own plan splits every attention it would gather for."""
    mlp = {"model.layers.*.mlp.gate_proj": "column", "model.layers.*.mlp.up_proj": "column",
           "model.layers.*.mlp.down_proj": "row"}
    got = []
    try:
        parallelize(build("llama"), Mesh(tp=2).build(30), Layout(tp=2, sequence_parallel=True), plan=mlp)
        got.append("parallelized")
    except ValueError as e:
        got.append(str(e))
    return got


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sequence_parallelism_with_a_plan_of_yours_is_refused():
    for per_rank in _spawn(2):
        (message,) = per_rank[-1]["messages"]
        assert "sequence_parallel needs a model-family plan" in message and "{module: style} mapping" in message, \
            message


@functools.cache
def _spawn(world: int) -> list[dict]:
    layouts = LAYOUTS_2 if world == 2 else LAYOUTS_4
    return run_ranks(_all, world, layouts, timeout_s=280)


@functools.cache
def _reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(name)
    opt = optimizer(model.parameters())
    losses = []
    for x, y in batches(DATA):
        loss = lm_loss(output_tensor(model(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check(world: int, index: int) -> None:
    per_rank = _spawn(world)
    got = per_rank[0][index]
    family = got["label"].split()[0]
    want_losses, want = _reference(family)
    tol = TOL_FLOAT32_NORMS if family in FLOAT32_NORMS else TOL  # the Gemmas', the OLMos' weights
    loss_tol = TOL
    if family in QK_NORMS_OVER_HEADS and got["tp"] > 1:  # the forward itself differs by float32's rounding
        tol, loss_tol = TOL_FLOAT32_FORWARD, 1e-7
    for r, layouts in enumerate(per_rank):
        errs = [abs(a - b) for a, b in zip(layouts[index]["losses"], want_losses, strict=True)]
        assert max(errs) <= loss_tol, f"{got['label']} rank {r}: losses {layouts[index]['losses']} vs {want_losses}"
    assert list(got["state"]) == list(want), f"{got['label']}: names {list(got['state'])} vs {list(want)}"
    name, err = max_error(got["state"], want)
    assert err <= tol, f"{got['label']}: final weights off one process, worst {name}: {err:.3g}"
    # the layout really applied: tp shards some weights, pp keeps a part of the model on each rank
    whole = sum(t.numel() * t.element_size() for k, t in want.items() if k != "lm_head.weight" or
                "transformer.wte.weight" not in want)
    assert (got["sharded"] > 0) == (got["tp"] > 1), (got["label"], got["sharded"])
    if got["tp"] > 1 or got["pp"] > 1:
        assert got["held"] < whole, f"{got['label']}: rank 0 holds {got['held']} of {whole} bytes"
    if got["tp"] > 1 and family not in OWN and not got["sp"]:  # attention and the MLP each all-reduce their input's gradient once,
        # not once per column layer (q, k and v; gate and up): what reaches them inside is a sum over the heads
        within = [site.rpartition(".")[2] for site in got["backward"] if ".layers." in site or ".h." in site]
        assert within and set(within) <= {"self_attn", "mlp", "attn", "q_norm", "k_norm"}, (got["label"], within)
    if got["label"].endswith(" sp"):
        _check_sequence_parallel(got, next(r for r in per_rank[0] if r["label"] == got["label"][:-3]))
    if got["label"].endswith(" zb sp"):  # the split backward gathers as often as the one it splits
        fused = next(r for r in per_rank[0] if r["label"] == got["label"].replace(" zb", ""))
        key = ("backward", "tp.all_gather")
        assert got["ops"][key] == fused["ops"][key] > 0, (got["label"], got["ops"], fused["ops"])


def _check_sequence_parallel(got: dict, plain: dict) -> None:
    """Sequence parallelism really ran, beside the same model and layout without it: each block's forward
    all-reduce became a reduce-scatter, with the all-gathers before the regions; the head (but GPT-2's, whose
    norm output is gathered for it) gathers the sequence itself, its backward no all-reduce; and a pipeline's
    stages send half the activation (each rank's T/2 tokens)."""
    ops, was = got["ops"], plain["ops"]
    scatters = ops[("forward", "tp.reduce_scatter")]
    assert scatters > 0 and was[("forward", "tp.reduce_scatter")] == 0, (got["label"], ops)
    assert was[("forward", "tp.all_reduce")] - ops[("forward", "tp.all_reduce")] == scatters, (got["label"], ops, was)
    assert ops[("forward", "tp.all_gather")] >= scatters, (got["label"], ops)
    if got["pp"] == 1 and not got["label"].startswith("gpt2"):  # rank 0 holds the head, which gathers the
        # sequence itself: its backward reduce-scatters
        assert "lm_head" in plain["backward"] and "lm_head" not in got["backward"], (got["label"], got["backward"])
    if got["pp"] > 1:
        assert 0 < got["sent"] < plain["sent"] * 0.6, (got["label"], got["sent"], plain["sent"])


CASES = [(world, i, f"{m} {lab}") for world, layouts in ((2, LAYOUTS_2), (4, LAYOUTS_4))
         for i, (m, lab) in enumerate([*((m, lab) for m in MODELS for lab in layouts),
                                       *((m, lab) for m, lab, _ in EXTRA[world])])]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "index"), [c[:2] for c in CASES], ids=[c[2] for c in CASES])
def test_layout_equals_one_process(world, index):
    _check(world, index)


def test_each_layer_reads_its_own_window_from_its_config():
    import transformers

    from fourfold.models import hf

    assert hf.sliding_window(transformers.MistralConfig(sliding_window=None)) is None
    assert hf.sliding_window(transformers.Qwen2Config(sliding_window=4)) is None  # use_sliding_window off
    windowed = transformers.Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                        num_hidden_layers=2)
    assert [hf.sliding_window(windowed, i) for i in range(2)] == [None, 4] and hf.sliding_window(windowed) == 4
    # as each family's own forward reads them: Llama ignores a sliding_window key, Mistral reads no layer_types
    assert hf.sliding_window(transformers.LlamaConfig(sliding_window=4)) is None
    mistral = transformers.MistralConfig(sliding_window=4, num_hidden_layers=2)
    mistral.layer_types = ["full_attention", "sliding_attention"]
    assert [hf.sliding_window(mistral, i) for i in range(2)] == [4, 4]
    band = hf.windowed(None, 2, 4, "cpu")[0, 0]
    assert band.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert hf.windowed(None, 4, 4, "cpu") is None  # the window covers the sequence: plain causal


def test_eager_attention_reads_fourfolds_masks_as_sdpa_does_and_other_kinds_are_refused():
    """Eager attention adds its mask to the scores and applies no causal mask of its own: packed documents get
    the same logits through it as through SDPA (the layouts above run it under pp, every piece given its mask);
    an implementation that reads no such mask is refused, naming the fix."""
    from fourfold.data.packing import document_layout
    from fourfold.models import hf

    sdpa, eager = build("gpt2"), build("gpt2-eager")
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))
    with document_layout(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]])):
        packed = sdpa(ids).logits
        assert torch.allclose(eager(ids).logits, packed, rtol=0, atol=1e-12)
    assert not torch.allclose(sdpa(ids).logits, packed, atol=1e-3)  # the documents' masks mattered
    assert torch.allclose(eager(ids).logits, sdpa(ids).logits, rtol=0, atol=1e-12)  # unpacked: its own mask
    mask = hf.as_read(eager.config, None, 3, torch.float32, "cpu")[0, 0]
    low = torch.finfo(torch.float32).min
    assert mask.tolist() == [[0, low, low], [0, 0, low], [0, 0, 0]]  # causal, as transformers' own eager masks
    assert hf.as_read(sdpa.config, None, 3, torch.float32, "cpu") is None  # SDPA's own causal flag
    llama = build("llama")
    llama.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="a pipeline \\(pp=2\\) passes .* attn_implementation='flex_attention'. "
                                         ".*set_attn_implementation\\('sdpa'\\)"):
        hf.check_attention(llama, "a pipeline (pp=2)")
    with document_layout(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])), pytest.raises(ValueError, match="a packed batch"):
        llama(ids[:1])


def test_a_gemma_that_attends_both_ways_is_refused_and_capped_scores_run_eager_attention():
    """An embedding model's config (use_bidirectional_attention): fourfold's masks are causal. Soft-capped
    attention scores (Gemma 2's by default, a Gemma 3's if set), which SDPA does not compute, run eager
    attention, as every Gemma 2 does."""
    from fourfold.models.hf import build_hf, hf_config

    with pytest.raises(ValueError, match="gemma3_text use_bidirectional_attention must be false"):
        hf_config("gemma3_text", overrides={**GEMMA3, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="gemma2 use_bidirectional_attention must be false"):
        hf_config("gemma2", overrides={**GEMMA2, "use_bidirectional_attention": True})
    built = [build_hf(name, overrides=config).config._attn_implementation for name, config in
             (("gemma2", GEMMA2), ("gemma3_text", {**GEMMA3, "attn_logit_softcapping": 50.0}),
              ("gemma3_text", GEMMA3), ("gemma2", {**GEMMA2, "attn_logit_softcapping": None}))]
    assert built == ["eager", "eager", "sdpa", "eager"], built  # transformers' Gemma 2 runs no SDPA


def test_a_misspelt_config_key_is_refused_naming_the_key_it_meant(tmp_path):
    """transformers keeps a key its config does not read as an attribute and builds its default: ``n_layr`` gave
    a 12-layer GPT-2, ``atn_pdrop`` left dropout at 0.1, silently. A key close to one it reads is refused; other
    unknown keys (older versions' ``n_ctx``, ``rope_theta`` in Hugging Face's own files) pass."""
    import json

    from fourfold.models.hf import hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"n_layr": 2, "atn_pdrop": 0.0, "n_embd": 16, "n_head": 2}))
    with pytest.raises(ValueError, match=r"model_config's keys must be GPT2Config's, got 'n_layr' \(did you mean "
                                         r"'n_layer'\?\), 'atn_pdrop' \(did you mean 'attn_pdrop'\?\) in .*config.json"):
        hf_config("gpt2", path)
    path.write_text(json.dumps({"n_layer": 2, "attn_pdrop": 0.0, "n_ctx": 1024, "n_embd": 16, "n_head": 2}))
    assert hf_config("gpt2", path).n_layer == 2
    path.write_text(json.dumps({**LLAMA, "num_hidden_layer": 1}))
    with pytest.raises(ValueError, match=r"'num_hidden_layer' \(did you mean 'num_hidden_layers'\?\)"):
        hf_config("llama", path)
    path.write_text(json.dumps({**LLAMA, "rope_theta": 10000.0}))
    assert hf_config("llama", path).num_attention_heads == 4


def test_a_config_without_model_type_holding_a_look_alikes_keys_is_refused(tmp_path):
    """Experts in a dense Qwen3, Phi-1 keys as Phi-3: the family's class would ignore them and build another model
    (a dense one) without a word. Named by the keys when the file names no model_type."""
    import json

    from fourfold.models.hf import hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "num_experts": 4, "num_experts_per_tok": 2}))
    with pytest.raises(ValueError, match=r"holds 'num_experts', 'num_experts_per_tok' in .*, keys of qwen3_moe .* "
                                         r"built without them \(a dense qwen3\)"):
        hf_config("qwen3", path)
    path.write_text(json.dumps({**LLAMA, "qk_layernorm": True}))
    with pytest.raises(ValueError, match=r"'qk_layernorm' .*keys of phi "):
        hf_config("phi3", path)
    path.write_text(json.dumps({**LLAMA, "num_local_experts": 8}))
    with pytest.raises(ValueError, match=r"keys of mixtral"):
        hf_config("mistral", path)
    assert hf_config("qwen3", overrides={**LLAMA}).num_attention_heads == 4  # its own keys: built


def test_a_config_of_another_architecture_is_refused_naming_the_family_to_pass(tmp_path):
    """A config.json says which architecture it is (model_type); transformers would take a Mixtral's keys as a
    Mistral's and build a dense model silently."""
    import json

    from fourfold.models.hf import hf_config, named_like

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **LLAMA}))
    with pytest.raises(ValueError, match="model_config must be a mistral config .* got model_type='llama' in .* Pass "
                                         "--model llama"):
        hf_config("mistral", path)
    assert hf_config("llama", path).num_attention_heads == 4
    path.write_text(json.dumps({"model_type": "mixtral", **LLAMA}))
    with pytest.raises(ValueError, match="got model_type='mixtral' .* fourfold has no plan or split for it"):
        hf_config("mistral", path)
    families = ("tinygpt", "gpt2", "llama", "qwen2", "gemma", "gemma3_text", "phi3")
    assert [named_like(n, families) for n in ("Phi-3", "LLAMA3", "qwen2.5", "gemma3", "mixtral", "gemma2")] == \
        ["phi3", "llama", "qwen2", "gemma3_text", None, None]  # no guess between architectures
