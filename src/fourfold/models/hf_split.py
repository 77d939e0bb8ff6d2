"""Each Hugging Face family's pipeline split, and the masks fourfold gives attention (:mod:`fourfold.models.hf`):
GPT-2 as its embeddings, blocks, then ln_f and the head; the Llama-shaped families as the token embedding, their
decoder layers (each computing its rotary embedding) and norm and head, with what a family's forward adds outside
the layers (Granite's multipliers, Gemma 3's soft cap). Where fourfold passes attention its mask (a pipeline's
pieces, packed documents: :func:`read_documents`) the family's sliding window is in it (:func:`windowed`), as
its own forward applies it under dp and tp. The masks are made boolean, True where a token may attend, and given
to attention in the form its implementation reads (:func:`as_read`): as they are to SDPA, added to the scores by
eager attention (0 or the dtype's lowest; Gemma 2's, and any model whose scores are soft-capped, which SDPA does not
compute); other implementations are refused (:func:`check_attention`).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn

from fourfold.data.packing import current_layout
from fourfold.models.attention import position_ids
from fourfold.parallel.context import current_shard
from fourfold.parallel.pipeline.blocks import Split
from fourfold.parallel.tensor.regions import full_length

__all__ = ["EVERY_LAYER_WINDOWS", "PER_LAYER_WINDOWS", "READS_MASKS", "as_read", "check_attention", "family_split",
           "gpt2_split", "layer_mask", "llama_split", "read_documents", "sliding_window", "windowed"]


_READING: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose forward reads the layout already


def read_documents(model: nn.Module) -> None:
    """Make the whole model keep packed documents apart: while a layout is current (the engine sets it), its
    forward gets the layout's ``position_ids`` (B, T) and block-diagonal causal mask as a 4-D
    ``attention_mask`` (B, 1, T, T), which transformers passes to SDPA as it is. The pipeline's pieces below
    read the layout themselves. Under context parallelism it gets the shard's positions instead
    (:mod:`fourfold.models.hf_context`)."""
    if model not in _READING:
        model.register_forward_pre_hook(_documents_kwargs, with_kwargs=True)
        _READING.add(model)


READS_MASKS = ("sdpa", "eager")
"""The attention implementations fourfold's masks are given to, each in the form it reads (:func:`as_read`)."""


def check_attention(model: nn.Module, needs: str) -> None:
    """Refuse a model whose attention fourfold cannot give its masks, which ``needs`` (a pipeline, packed
    documents) passes its layers: SDPA and eager attention read them (:func:`as_read`); flash attention takes no
    mask, and flex attention another kind."""
    used = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if used not in (None, *READS_MASKS):
        raise ValueError(f"{needs} passes the model's layers fourfold's attention masks, which SDPA and eager "
                         f"attention read, got a model with attn_implementation={used!r}. Build it with "
                         "attn_implementation='sdpa' (from_pretrained(..., attn_implementation='sdpa')), or call "
                         "model.set_attn_implementation('sdpa') before parallelize ('eager' where its scores "
                         "are soft-capped: SDPA computes no cap).")


def as_read(config: Any, mask: torch.Tensor | None, tokens: int, dtype: torch.dtype,
            device: Any) -> torch.Tensor | None:
    """``mask`` (boolean, True where a token may attend; None: plain causal over ``tokens``) in the form
    ``config``'s attention implementation reads it: SDPA's as it is (None: its own causal flag); eager attention
    adds the mask to its scores, so 0 where a token may attend and ``dtype``'s lowest value elsewhere (what
    transformers' own eager masks hold), and always one, since it applies no causal mask of its own."""
    return _in_form(getattr(config, "_attn_implementation", None), mask, tokens, dtype, torch.device(device))


def _in_form(implementation: str | None, mask: torch.Tensor | None, tokens: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor | None:
    if implementation != "eager":
        return mask
    keep = mask if mask is not None else torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()[None, None]
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, torch.finfo(dtype).min)


def layer_mask(config: Any, window: int | None, tokens: int, dtype: torch.dtype, device: Any) -> torch.Tensor | None:
    """What a layer whose attention reads ``config`` is given: the packed batch's mask (none: plain causal),
    within ``window``, in the form its attention reads (:func:`as_read`). Made once per packed batch (kept by its
    layout), or once per size without one, not once per layer and micro-batch."""
    layout, implementation = current_layout(), getattr(config, "_attn_implementation", None)
    if current_shard() is not None:  # context parallelism: fourfold's attention masks by positions itself
        return None
    if layout is None:
        return _unpacked(implementation, window, tokens, dtype, torch.device(device))
    return layout.derived(("mask", window, implementation, dtype), lambda: _in_form(
        implementation, windowed(layout.mask, window, tokens, device), tokens, dtype, torch.device(device)))


@functools.lru_cache(maxsize=4)
def _unpacked(implementation: str | None, window: int | None, tokens: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor | None:
    """:func:`layer_mask` without a packed batch: SDPA's None (its causal flag) or window band, eager attention's
    (T, T) additive mask. Four kept: each kind of layer (windowed or not), at a training run's length and its
    held-out loss's (eager: T^2 values each, 256 MB in float32 at T = 8192, what one head's scores of one sample
    take)."""
    return _in_form(implementation, windowed(None, window, tokens, device), tokens, dtype, device)


def _documents_kwargs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    shard = current_shard()
    if shard is not None:  # context parallelism: this rank's positions; its attention needs no mask
        pos = shard.document_positions(0, shard.mine.numel())
        return args, {**kwargs, "position_ids": pos if pos.dim() == 2 else pos[None], "attention_mask": None}
    layout = current_layout()
    if layout is None:
        return None
    check_attention(module, "a packed batch")
    config = getattr(module, "config", None)
    tokens, device = layout.mask.size(-1), layout.mask.device
    dtype = next(module.parameters()).dtype  # what the first layer's scores are computed in
    window = sliding_window(config)
    mask: Any
    if window is not None and getattr(config, "model_type", None) in PER_LAYER_WINDOWS:  # a mask per kind of layer
        mask = {kind: layer_mask(config, window if kind == "sliding_attention" else None, tokens, dtype, device)
                for kind in set(config.layer_types)}  # type: ignore[union-attr]
    else:  # Mistral: every layer (no window: the mask as it is)
        mask = layer_mask(config, window, tokens, dtype, device)
    return args, {**kwargs, "position_ids": layout.positions, "attention_mask": mask}


def _gpt2_before(m: Any, ids: torch.Tensor) -> torch.Tensor:
    t = m.transformer
    return t.drop(t.wte(ids) + t.wpe(position_ids(ids)))


def _gpt2_block(m: Any, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    tokens = full_length(layer, h)  # h's sequence, or its shard under sequence parallelism
    out = layer(h, attention_mask=layer_mask(getattr(layer.attn, "config", None), None, tokens, h.dtype, h.device))
    return out[0] if isinstance(out, tuple) else out


def _gpt2_after(m: Any, h: torch.Tensor) -> torch.Tensor:
    return m.lm_head(m.transformer.ln_f(h))


def gpt2_split(model: nn.Module) -> Split:
    """GPT-2 as embeddings (token + learned position, dropout), its blocks, then ln_f and the head."""
    return Split(blocks="transformer.h", before=_gpt2_before, block=_gpt2_block, after=_gpt2_after)


def _llama_before(m: Any, ids: torch.Tensor) -> torch.Tensor:
    return m.model.embed_tokens(ids)


def _scaled_before(multiplier: float, m: Any, ids: torch.Tensor) -> torch.Tensor:
    """Granite's first piece: the embedding times ``embedding_multiplier``, as its model's forward scales it."""
    return _llama_before(m, ids) * multiplier


EVERY_LAYER_WINDOWS = ("mistral", "phi3")
"""Families whose ``sliding_window`` (when set) applies to every layer: their forward builds a windowed mask."""


PER_LAYER_WINDOWS = ("qwen2", "qwen3", "gemma2", "gemma3_text", "olmo3", "smollm3")
"""Families whose layers each attend within a window or not, as their config's ``layer_types`` say (their
forward takes one mask per kind of layer); Mistral's window is on every layer; the others have none."""


def sliding_window(config: Any, layer: int | None = None) -> int | None:
    """The attention window of ``layer`` (of any layer: None) as the family's own forward applies it, else None:
    Mistral's and Phi-3's ``sliding_window`` on every layer (their forward reads no ``layer_types``); Qwen2's and
    Qwen3's, with ``use_sliding_window``, and Gemma 3's (no switch), on the layers their ``layer_types`` mark
    ``sliding_attention``; no other family's (Llama's forward ignores a ``sliding_window`` key)."""
    kind, window = getattr(config, "model_type", None), getattr(config, "sliding_window", None)
    if not window or kind not in (*EVERY_LAYER_WINDOWS, *PER_LAYER_WINDOWS):
        return None
    if kind in PER_LAYER_WINDOWS:
        types = getattr(config, "layer_types", None) or []
        if not getattr(config, "use_sliding_window", True) or \
                "sliding_attention" not in (types if layer is None else types[layer:layer + 1]):
            return None
    return int(window)


def windowed(mask: torch.Tensor | None, window: int | None, tokens: int, device: Any) -> torch.Tensor | None:
    """``mask`` (a packed batch's (B, 1, T, T), or None: plain causal) with each query kept to the ``window``
    keys before it, itself included, as transformers' sliding-window mask keeps them (query i sees key j when
    0 <= i - j < window); ``mask`` as it is without a window or with sequences no longer than it."""
    if window is None or tokens <= window:
        return mask
    band = _band(tokens, window, torch.device(device))
    return band if mask is None else mask & band


@functools.lru_cache(maxsize=2)
def _band(tokens: int, window: int, device: torch.device) -> torch.Tensor:
    """(1, 1, T, T) bool: j <= i < j + window. Made once per size (every layer, micro-batch and recompute reads
    it), as booleans: no T x T integer tensor."""
    ones = torch.ones(tokens, tokens, dtype=torch.bool, device=device)
    return (ones.tril() & ~ones.tril(-window))[None, None]


def _llama_block(m: Any, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    attention: Any = layer.self_attn  # a piece of the pipeline holds the layers, not the model: its config is theirs
    config: Any = getattr(attention, "config", None)
    window = sliding_window(config, getattr(attention, "layer_idx", None))
    tokens = full_length(layer, h)  # h's sequence, or its shard under sequence parallelism
    pos = _positions(h, tokens)  # (1, T), or (B, T) restarting at each packed document
    rotary = m.model.rotary_emb  # (cos, sin): no parameters; Gemma 3's and OLMo 3's, a frequency per kind of layer
    rope = rotary(h, pos, config.layer_types[attention.layer_idx]) if hasattr(rotary, "layer_types") else \
        rotary(h, pos)
    return layer(h, attention_mask=layer_mask(config, window, tokens, h.dtype, h.device), position_embeddings=rope,
                 position_ids=pos)


def _positions(h: torch.Tensor, tokens: int) -> torch.Tensor:
    """The positions of a sequence of ``tokens`` (h's, or the whole one h is a shard of): (1, T), or the packed
    batch's (B, T), each token's offset in its document."""
    layout = current_layout()
    if layout is None:
        return torch.arange(tokens, device=h.device).unsqueeze(0)
    layout.check((h.size(0), tokens), "the hidden states")
    return layout.positions


def _llama_after(m: Any, h: torch.Tensor) -> torch.Tensor:
    return m.lm_head(m.model.norm(h))


def _scaled_after(divisor: float | None, cap: float | None, m: Any, h: torch.Tensor) -> torch.Tensor:
    """The last piece of a family whose causal LM's forward changes the head's logits: Granite's divided by
    ``logits_scaling``, Gemma 3's soft-capped by ``final_logit_softcapping`` (tanh(x / cap) * cap)."""
    logits = _llama_after(m, h)
    if divisor is not None:
        logits = logits / divisor
    return logits if cap is None else torch.tanh(logits / cap) * cap


def llama_split(model: nn.Module) -> Split:
    """Llama as the token embedding, its decoder layers (each computing RoPE for its positions), norm and head;
    what a family's forward does beyond them done too: Granite's ``embedding_multiplier`` and ``logits_scaling``,
    Gemma 3's ``final_logit_softcapping`` (the split check, run on a filled model, refuses a split that leaves them
    out). Only those families' forwards read those keys, so only theirs are: a stray key copied into another
    family's config changes nothing, as it changes nothing in that model's own forward."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    multiplier = getattr(config, "embedding_multiplier", None) if kind == "granite" else None
    divisor = getattr(config, "logits_scaling", None) if kind == "granite" else None
    cap = getattr(config, "final_logit_softcapping", None) if kind in ("gemma2", "gemma3_text") else None
    before = _llama_before if multiplier is None else functools.partial(_scaled_before, float(multiplier))
    after = _llama_after if divisor is None and cap is None else functools.partial(
        _scaled_after, None if divisor is None else float(divisor), None if cap is None else float(cap))
    return Split(blocks="model.layers", before=before, block=_llama_block, after=after)


def family_split(model: nn.Module) -> Split:
    """The split of ``model``'s family: GPT-2's, or Llama's for every Llama-shaped family."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return gpt2_split(model) if kind == "gpt2" else llama_split(model)
