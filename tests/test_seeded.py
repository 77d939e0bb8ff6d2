"""A fresh Hugging Face model's first weights, made a layer at a time from the seed (fourfold.models.seeded): the
same values whole in one process or unit by unit in any order, by the family's own initialisation rule, and
under a layout each rank makes only the layers it holds, yet starts where one process starts.

Reading a failure: values that differ with the order read means a unit's generator is not its own (seeded by
something other than the seed and the unit's name); a rank that made a layer it does not hold means
engine.load_state_dict asked for tensors outside the rank's stages."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

LLAMA = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 16}
GPT2 = {"vocab_size": 64, "n_positions": 16, "n_embd": 32, "n_layer": 4, "n_head": 2}


def test_seeded_weights_are_the_whole_builds_in_any_order_and_follow_the_familys_rule():
    from fourfold.models.hf import build_hf, seeded

    for family, config in (("gpt2", GPT2), ("llama", LLAMA)):
        whole = build_hf(family, overrides=config, seed=5, dtype=torch.float64).state_dict()
        unfilled = build_hf(family, overrides=config, seed=5, dtype=torch.float64, filled=False)
        assert all(float(p.detach().abs().sum()) == 0.0 for p in unfilled.parameters())
        weights = seeded(unfilled, 5)
        assert list(weights) == list(whole)
        for name in reversed(list(weights)):  # the head first, the embedding last: each unit its own generator
            assert torch.equal(weights[name].double(), whole[name]), (family, name)
        other = build_hf(family, overrides=config, seed=6, dtype=torch.float64).state_dict()
        assert not torch.equal(other[next(iter(other))], whole[next(iter(whole))])  # the seed decides
    # transformers' rule for GPT-2, applied layer by layer: a projection into the residual stream drawn with
    # std 0.02 / sqrt(2 n_layer), the others with 0.02, layer norms at 1 and 0, the head tied to the embedding
    gpt2 = build_hf("gpt2", overrides=GPT2, seed=5, dtype=torch.float64)
    h = gpt2.transformer.h
    assert math.isclose(float(h[3].attn.c_proj.weight.detach().std()), 0.02 / math.sqrt(8), rel_tol=0.1)
    assert math.isclose(float(h[3].mlp.c_fc.weight.detach().std()), 0.02, rel_tol=0.1)
    assert torch.equal(h[0].ln_1.weight, torch.ones(32, dtype=torch.float64))
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert not torch.equal(h[0].attn.c_attn.weight, h[1].attn.c_attn.weight)  # each layer its own draws


def _filled_by_layers(ctx, config: dict) -> dict:
    """tp2 x pp2: each rank fills its part of a fresh Llama from the seed, recording the units it made."""
    from fourfold import Layout, Mesh, parallelize
    from fourfold.models.hf import build_hf, seeded
    from fourfold.models.seeded import SeededInit

    made: list[str] = []
    make = SeededInit.make
    SeededInit.make = lambda self, unit: (made.append(unit), make(self, unit))[1]  # type: ignore[method-assign]
    model = build_hf("llama", overrides=config, seed=5, dtype=torch.float64, filled=False)
    weights = seeded(model, 5)
    ranks = Mesh.for_world(ctx.world_size, tp=2, pp=2).build(30)
    engine = parallelize(model, ranks, Layout(tp=2, pp=2, microbatches=2),
                         example=torch.zeros(1, 8, dtype=torch.long))
    engine.load_state_dict(weights)
    return {"made": sorted(set(made)), "pp": ranks.coord.pp, "state": engine.state_dict(to=0)}


@pytest.mark.timeout(240)
def test_each_rank_makes_only_the_layers_it_holds_and_starts_where_one_process_starts():
    from fourfold.models.hf import build_hf
    from fourfold.testing import run_ranks

    got = run_ranks(_filled_by_layers, 4, LLAMA, timeout_s=200)
    whole = build_hf("llama", overrides=LLAMA, seed=5, dtype=torch.float64).state_dict()
    assert list(got[0]["state"]) == list(whole)
    for name, value in whole.items():
        assert torch.equal(got[0]["state"][name], value), name
    stages = {0: ["model.embed_tokens", "model.layers.0", "model.layers.1"],
              1: ["lm_head", "model.layers.2", "model.layers.3", "model.norm"]}
    for r in got:  # the embedding and the first two layers on pp rank 0, the rest on 1: each makes its own
        assert r["made"] == stages[r["pp"]], (r["pp"], r["made"])


def test_a_parameter_the_rule_leaves_unwritten_is_refused_by_name():
    from torch import nn

    from fourfold.models.hf import build_hf
    from fourfold.models.seeded import SeededInit

    def linear_only(m: nn.Module) -> None:  # a rule that knows no norm
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight)

    model = build_hf("llama", overrides=LLAMA, seed=5, dtype=torch.float64, filled=False)
    with SeededInit(model, 5, blocks="model.layers", init=linear_only) as weights:
        assert torch.isfinite(weights["lm_head.weight"]).all()
        with pytest.raises(ValueError, match=r"must write every parameter of 'model.layers.1', got "
                                             r"model.layers.1.input_layernorm.weight, "
                                             r"model.layers.1.post_attention_layernorm.weight left unwritten"):
            weights["model.layers.1.mlp.up_proj.weight"]
    assert weights._made is None  # the with block let go of the unit it kept
