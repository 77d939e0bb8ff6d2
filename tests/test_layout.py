"""``Layout``: every parallel setting in one value that checks itself, and ``parallelize`` as ordered steps.

Pure tests (no processes) except the last two, which compare the older keyword signature with the Layout on one
process and on 2 ranks. Reading a failure: a rule test names the setting it refuses; the deprecation tests name
the keyword whose new home changed.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch

from fourfold import Layout, Mesh, parallelize
from fourfold.config import TrainConfig
from fourfold.engine.parallelize import MOVED, apply_ac, apply_dp, apply_pp
from fourfold.mesh import RankMesh
from fourfold.models import GPTConfig, TinyGPT
from fourfold.run.args import parse_args
from fourfold.testing import run_ranks
from helpers import batches, max_error, optimizer

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)


@pytest.mark.parametrize("values,message", [
    ({"tp": 0}, r"tp must be an integer >= 1, got tp=0"),
    ({"dp": 0}, r"dp must be an integer >= 1, got dp=0\. Leave it out"),
    ({"cp": 2, "sync_batchnorm": True}, r"sync_batchnorm under context parallelism is not built.*Drop"),
    ({"cp": 2, "cp_algorithm": "flash"}, r"cp_algorithm must be one of ring, allgather, ulysses"),
    ({"ep": 2}, r"ep is expert parallelism \(issue 49\): not built yet"),
    ({"dp_shard": 2}, r"dp_shard is data parallelism as replicate x shard"),
    ({"schedule": "1F1B"}, r"schedule must be one of naive, gpipe, 1f1b, interleaved, zb, got schedule='1F1B'"),
    ({"zero": 2, "allreduce": "tree"}, r"got zero=2 with allreduce='tree'\. Pass --allreduce ring or native"),
    ({"zero": 4}, r"zero must be 0 \(off\), 1, 2 or 3, got zero=4"),
    ({"compress": "int8", "zero": 1}, r"compress int8 replaces the all-reduce.*Drop one"),
    ({"compress": "int8", "reduce_dtype": "bfloat16"}, r"Leave --reduce-dtype auto"),
    ({"grad_accum": 2, "pp": 2}, r"Pass --microbatches 8 instead of --grad-accum"),
    ({"strategy": "model"}, r"strategy 'model' places layers on pipeline ranks, got pp=1"),
    ({"sequence_parallel": True}, r"sequence_parallel needs tensor parallelism, got tp=1"),
    ({"find_unused_parameters": True, "zero": 1}, r"find_unused_parameters works with plain data parallelism"),
    ({"activation_checkpointing": "some"}, r"activation_checkpointing must be none, full"),
    ({"bucket_mb": 0}, r"bucket_mb must be > 0, got bucket_mb=0"),
])
def test_each_rule_refuses_naming_the_values_and_the_fix(values, message):
    with pytest.raises(ValueError, match=message):
        Layout(**values)


def test_the_mesh_is_the_layouts():
    assert Layout(tp=2, pp=2).mesh(8) == Mesh(dp=2, tp=2, pp=2)
    with pytest.raises(ValueError, match="world size must be divisible by tp\\*pp"):
        Layout(tp=3).mesh(4)
    with pytest.raises(ValueError, match="the mesh must be the layout's, got a mesh of dp=1 tp=2 pp=1 for a layout"):
        Layout(pp=2).check_mesh(Mesh(tp=2))
    Layout(tp=2).check_mesh(Mesh(dp=4, tp=2))  # dp left out: the mesh's
    assert Layout(tp=2).for_mesh(Mesh(dp=3, tp=2)).dp == 3


def test_the_cli_and_the_library_build_the_same_layout():
    cfg = parse_args(["--nproc", "4", "--tp", "2", "--zero", "1", "--allreduce", "ring", "--microbatches", "2",
                      "--boundaries", "1,blocks.1"])
    assert cfg.parallel == Layout(tp=2, zero=1, allreduce="ring", microbatches=2, boundaries=(1, "blocks.1"))
    assert not set(TrainConfig.__dataclass_fields__) & set(Layout.__dataclass_fields__)  # each setting once


def test_every_old_keyword_has_a_home():
    old = ["tp_plan", "sequence_parallel", "schedule", "microbatches", "virtual", "strategy", "allreduce", "bucket_mb",
           "sync_batchnorm", "find_unused_parameters", "activation_checkpointing", "zero", "precision",
           "reduce_dtype", "compress", "balance", "grad_accum", "boundaries", "seed", "tracer", "timeout_s"]
    assert set(old) <= set(MOVED)
    assert list(inspect.signature(parallelize).parameters)[:3] == ["model", "mesh", "layout"]
    with pytest.warns(DeprecationWarning, match=r"parallelize\(zero=\.\.\.\) is deprecated: use Layout\(zero=\.\.\.\)"):
        parallelize(TinyGPT(CFG), None, zero=1, allreduce="ring")
    with pytest.raises(TypeError, match="got a layout and the older keywords \\['zero'\\] beside it"):
        parallelize(TinyGPT(CFG), None, Layout(), zero=1)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['schedul'\\]"):
        parallelize(TinyGPT(CFG), None, schedul="1f1b")
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['tp'\\]"):  # sizes never were keywords
        parallelize(TinyGPT(CFG), None, tp=2)
    with pytest.raises(TypeError, match="plan= and the older tp_plan= together"):
        parallelize(TinyGPT(CFG), None, plan={}, tp_plan={})
    with pytest.raises(ValueError, match="the mesh must be the layout's"):
        parallelize(TinyGPT(CFG), None, Layout(tp=2))


def test_the_steps_are_separate_functions():
    model, single = TinyGPT(CFG), RankMesh.single()
    assert apply_pp(model, single, Layout(), None, None, None, lambda a, b: a.sum(), None) is None
    assert apply_dp(model, single, Layout(), None, [], None) is None
    apply_ac(model, Layout(activation_checkpointing="full"), None, None)
    assert all(b._fourfold_checkpointed for b in model.blocks)


def _train(engine) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = optimizer(engine.parameters())
    losses = []
    for x, y in batches(CFG, steps=2):
        losses.append(engine.step(x, y).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, engine.state_dict()


def test_the_old_keywords_and_the_layout_train_alike_on_one_process():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), None, grad_accum=2)
    new = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), None, Layout(grad_accum=2))
    (l1, s1), (l2, s2) = _train(old), _train(new)
    assert l1 == l2 and max_error(s1, s2)[1] == 0.0


def _two_ranks(ctx):
    cfg = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)
    layout = Layout(pp=2, microbatches=2, schedule="gpipe")
    ranks = layout.mesh(ctx.world_size).build()
    engine = parallelize(TinyGPT(cfg, seed=0, dtype=torch.float64), ranks, layout)
    assert engine.layout == dataclasses.replace(layout, dp=1)
    x, y = batches(cfg, batch=4, steps=1)[0]
    return engine.step(x, y).item(), _optimisers_on_pieces(ctx, cfg)


def _optimisers_on_pieces(ctx, cfg) -> dict[str, str]:
    """Which optimisers step on what each layout gives them: refused where the pieces would change the update."""
    said = {}
    for label, layout in (("dp", Layout(dp=2)), ("zero1", Layout(dp=2, zero=1)), ("tp", Layout(tp=2))):
        for name in ("AdamW", "Adafactor", "Adafactor vouched"):
            engine = parallelize(TinyGPT(cfg, seed=0, dtype=torch.float64), layout.mesh(ctx.world_size).build(),
                                 layout)
            opt = getattr(torch.optim, name.split()[0])(engine.parameters(), lr=1e-3)
            opt.fourfold_elementwise = name.endswith("vouched")
            x, y = batches(cfg, batch=4, steps=1)[0]
            engine.step(x[ctx.rank * 2:][:2] if label != "tp" else x, y[ctx.rank * 2:][:2] if label != "tp" else y)
            try:
                opt.step()
                said[f"{label} {name}"] = "stepped"
            except ValueError as e:
                said[f"{label} {name}"] = str(e)
    return said


def test_a_layout_runs_on_its_mesh():
    results = run_ranks(_two_ranks, 2)
    assert results[0][0] == results[1][0]
    for _, said in results:  # optimisers that read a whole matrix are refused on ZeRO's and tp's pieces
        refused = {k for k, v in said.items() if v != "stepped"}
        assert refused == {"zero1 Adafactor", "tp Adafactor"}, said
        assert said["zero1 Adafactor"].startswith("Adafactor steps on ZeRO-1 segments (flat pieces that cross "
                                                  "parameters), and it is not known to compute each element"), said
        assert "Muon" in said["tp Adafactor"] and "tensor-parallel slices of weights" in said["tp Adafactor"], said
