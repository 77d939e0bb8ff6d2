"""TinyGPT: deterministic init, stage decomposition, causality, loss, config errors.

Pure tests, no processes. A failure in the determinism tests means two ranks building the model from one
seed would start from different weights; a failure in the Sequential test means pipeline stages no longer
compose to the model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fourfold.models import GPTConfig, TinyGPT, lm_loss

SMALL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def _idx(B: int = 3, T: int = 16, V: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))  # (B, T)


def _params(model: TinyGPT) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def test_same_seed_gives_identical_parameters_and_outputs() -> None:
    a, b = TinyGPT(SMALL, seed=7), TinyGPT(SMALL, seed=7)
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    x = _idx()
    assert torch.equal(a(x), b(x))


def test_different_seed_gives_different_parameters() -> None:
    a, b = TinyGPT(SMALL, seed=0), TinyGPT(SMALL, seed=1)
    assert not torch.equal(a.embed.wte.weight, b.embed.wte.weight)
    assert not torch.equal(a.blocks[1].mlp.proj.weight, b.blocks[1].mlp.proj.weight)


def test_float32_is_float64_rounded() -> None:
    m64 = TinyGPT(SMALL, seed=3, dtype=torch.float64)
    m32 = TinyGPT(SMALL, seed=3, dtype=torch.float32)
    for (name, p64), p32 in zip(m64.named_parameters(), m32.parameters(), strict=True):
        assert p64.dtype == torch.float64 and p32.dtype == torch.float32
        assert torch.equal(p64.float(), p32), name
    x = _idx()
    torch.testing.assert_close(m32(x).double(), m64(x), rtol=1e-4, atol=1e-5)


def test_init_ignores_and_preserves_global_rng() -> None:
    torch.manual_seed(1)
    before = torch.get_rng_state()
    a = TinyGPT(SMALL, seed=5)
    assert torch.equal(torch.get_rng_state(), before), "construction must not draw from the global RNG"
    torch.manual_seed(12345)
    b = TinyGPT(SMALL, seed=5)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_init_statistics() -> None:
    model = TinyGPT(GPTConfig(n_layer=8), seed=0, dtype=torch.float64)
    assert model.embed.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    scaled = torch.cat(
        [torch.cat([b.attn.proj.weight.flatten(), b.mlp.proj.weight.flatten()]) for b in model.blocks]
    )
    assert scaled.std().item() == pytest.approx(0.02 / 4.0, rel=0.05)  # 0.02 / sqrt(2 * 8)
    blk = model.blocks[0]
    assert (
        torch.all(blk.attn.qkv.bias == 0) and torch.all(blk.ln1.weight == 1) and torch.all(blk.ln1.bias == 0)
    )


def test_sequential_of_layers_equals_forward() -> None:
    model = TinyGPT(SMALL, seed=0).eval()
    layers = model.layers()
    assert layers[0] is model.embed and layers[-1] is model.head and len(layers) == SMALL.n_layer + 2
    x = _idx()
    assert torch.equal(torch.nn.Sequential(*layers)(x), model(x))


def test_tied_weights_share_one_parameter_and_count_once() -> None:
    tied = TinyGPT(SMALL, seed=0)
    untied = TinyGPT(dataclasses.replace(SMALL, tie_weights=False), seed=0)
    assert tied.head.lm_head.weight is tied.embed.wte.weight
    assert untied.head.lm_head.weight is not untied.embed.wte.weight
    counted_twice = sum(p.numel() for _, p in tied.named_parameters(remove_duplicate=False))
    assert tied.num_parameters() == counted_twice - SMALL.vocab_size * SMALL.d_model
    assert untied.num_parameters() == tied.num_parameters() + SMALL.vocab_size * SMALL.d_model


@pytest.mark.parametrize("t", [0, 5, 15])
def test_causal_later_tokens_do_not_change_earlier_logits(t: int) -> None:
    model = TinyGPT(SMALL, seed=0, dtype=torch.float64).eval()
    x = _idx()
    x2 = x.clone()
    x2[:, t] = (x2[:, t] + 1) % SMALL.vocab_size
    a, b = model(x), model(x2)  # (B, T, V)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, t], b[:, t])


def test_loss_is_cross_entropy_over_all_tokens() -> None:
    model = TinyGPT(SMALL, seed=0, dtype=torch.float64)
    x, y = _idx(seed=1), _idx(seed=2)
    logits, loss = model(x, targets=y)
    expected = F.cross_entropy(logits.reshape(-1, SMALL.vocab_size), y.reshape(-1))
    assert torch.equal(loss, expected)
    assert torch.equal(lm_loss(logits, y), expected)
    # the last position's logits only (nanoGPT's forward without targets): refused naming both shapes
    with pytest.raises(ValueError, match=r"one row of logits per target, \(B, T, vocab\) for targets \(B, T\), got "
                                         r"logits \(2, 1, 64\) for targets \(2, 8\)"):
        lm_loss(torch.zeros(2, 1, 64), torch.zeros(2, 8, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 0}, r"vocab_size must be a positive integer, got vocab_size=0"),
        ({"seq_len": -3}, r"seq_len must be a positive integer, got seq_len=-3"),
        ({"n_layer": 0}, r"n_layer must be a positive integer, got n_layer=0"),
        ({"n_head": 0}, r"n_head must be a positive integer, got n_head=0"),
        ({"d_model": 2.5}, r"d_model must be a positive integer, got d_model=2.5"),
        (
            {"d_model": 130, "n_head": 4},
            r"d_model must be divisible by n_head, got d_model=130, n_head=4\. Pass",
        ),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got dropout=1.0"),
        ({"dropout": -0.1}, r"dropout must be in \[0, 1\), got dropout=-0.1"),
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)  # type: ignore[arg-type]


def test_too_long_input_is_refused() -> None:
    model = TinyGPT(SMALL, seed=0)
    with pytest.raises(ValueError, match=r"T=17 > seq_len=16"):
        model(_idx(T=17))
    with pytest.raises(ValueError, match=r"T=17 > seq_len=16"):
        torch.nn.Sequential(*model.layers())(_idx(T=17))


def test_shorter_input_is_accepted() -> None:
    assert TinyGPT(SMALL, seed=0)(_idx(T=5)).shape == (3, 5, SMALL.vocab_size)


def test_non_float_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"dtype must be a floating-point dtype, got dtype=torch.int64"):
        TinyGPT(SMALL, dtype=torch.int64)


def test_float64_training_step_decreases_loss() -> None:
    model = TinyGPT(SMALL, seed=0, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _idx(seed=1), _idx(seed=2)
    losses = []
    for _ in range(3):
        _, loss = model(x, targets=y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    _, final = model(x, targets=y)
    assert losses[1] < losses[0] and final.item() < losses[-1]


def test_on_meta_skips_random_inits_of_meta_tensors_only() -> None:
    """Building on meta draws nothing (there are no values), so torch's Python meta kernels for random fills, and
    the compiler import behind them, are never reached; a real tensor made inside still draws."""
    import subprocess
    import sys

    from fourfold.models.meta import on_meta

    with on_meta():
        layer = torch.nn.Linear(4, 4)
        real = torch.empty(64, device="cpu")
        torch.nn.init.normal_(real)
    assert layer.weight.is_meta and real.std() > 0
    code = ("import sys\nfrom fourfold.models import GPTConfig, TinyGPT\nTinyGPT(GPTConfig(), seed=0)\n"
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stdout + done.stderr
