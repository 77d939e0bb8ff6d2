"""Hugging Face causal LMs, kept as fourfold keeps TinyGPT: each family's tensor-parallel plan, pipeline split and
tp checks, beside each other (as torchtitan keeps a plan per model family). Needs ``pip install fourfold[hf]``;
nothing is downloaded: models are built from a config.

* **GPT-2** (``GPT2LMHeadModel``): Conv1D layers (A stored (in, out)), the fused q|k|v ``c_attn`` split as
  ``column:3``, learned positions, the head tied to ``wte``. transformers ships no plan for it; this is ours.
* **Llama** (``LlamaForCausalLM``): RoPE, grouped-query attention, tied or untied head; its plan is the one the
  model carries (``model.tp_plan``, Hugging Face's vocabulary), read by
  :func:`~fourfold.parallel.tensor.tensor_parallel`.
* **Mistral, Qwen2, Qwen3** (``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``): Llama's layout
  (``model.layers``, ``model.rotary_emb``, ``model.norm``, ``lm_head``) and the same decoder-layer call, so
  Llama's split; Qwen2's q/k/v biases are column-parallel with their weights, Qwen3's per-head q/k norms are
  replicated with their gradients summed over tp (its plan's ``replicated_with_grad_allreduce``). A sliding
  window (Mistral's ``sliding_window`` on every layer, Qwen2's with ``use_sliding_window`` on the layers its
  ``layer_types`` say) is the model's own forward's under dp and tp; where fourfold gives attention its mask (the
  pipeline's pieces, packed documents) the window is in it too (:func:`windowed`).
* **Gemma** (``GemmaForCausalLM``): Llama's layout with an embedding scaled by sqrt(hidden_size) and norms
  computed in float32 (:data:`FLOAT32_NORMS`).
* **Gemma 3** (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``: the text-only models, Gemma 3 1B's and
  the language model of the larger ones): Gemma's embedding and norms, Qwen3's per-head q/k norms, a window on the
  layers its ``layer_types`` mark, rotary frequencies per kind of layer (the pipeline's pieces ask for the
  layer's own), and logits soft-capped where ``final_logit_softcapping`` is set (the last piece caps them too).
* **Granite** (``GraniteForCausalLM``): Llama's layout with multipliers: the embedding's, each residual
  branch's, the attention scores' (inside the layers), and the logits divided by ``logits_scaling`` (the
  pipeline's first and last pieces scale as its forward does).
* **Phi-3** (``Phi3ForCausalLM``, also Phi-4-mini's architecture): Llama's layout with fused projections, q|k|v in
  ``qkv_proj`` and gate|up in ``gate_up_proj``, each split block by block (:func:`fused_plan`), and Mistral's
  window on every layer.

The attention modules find their head count from the (split) projection's width, so a column-parallel q/k/v
gives each rank its own heads; GPT-2's ``split_size`` and Phi-3's head counts, which slice a fused output, are
what must follow (:func:`shard_fixups`).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from fourfold.data.packing import current_layout
from fourfold.models.attention import position_ids
from fourfold.parallel.pipeline.blocks import Split
from fourfold.parallel.tensor.layers import ColumnParallelLinear

__all__ = ["FAMILIES", "FLOAT32_NORMS", "GPT2_PLAN", "build_hf", "causal_lm_class", "check_attention", "check_supported",
           "check_tp", "examples", "fused_plan", "gpt2_split", "hf_family", "llama_split", "meta_kwargs", "prepare",
           "read_documents", "seeded", "shard_fixups", "sliding_window"]

GPT2_PLAN = {
    "transformer.wte": "vocab",
    "transformer.h.*.attn.c_attn": "column:3",  # [W_q | W_k | W_v]: each part split by heads
    "transformer.h.*.attn.c_proj": "row",
    "transformer.h.*.mlp.c_fc": "column",
    "transformer.h.*.mlp.c_proj": "row",
    "lm_head": "head",  # tied to wte: both split by vocabulary rows
}

_CLASSES = {"gpt2": ("GPT2LMHeadModel", "GPT2Config", "GPT-2"), "llama": ("LlamaForCausalLM", "LlamaConfig", "Llama"),
            "mistral": ("MistralForCausalLM", "MistralConfig", "Mistral"),
            "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", "Qwen2"), "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", "Qwen3"),
            "gemma": ("GemmaForCausalLM", "GemmaConfig", "Gemma"),
            "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextConfig", "Gemma 3"),
            "granite": ("GraniteForCausalLM", "GraniteConfig", "Granite"),
            "phi3": ("Phi3ForCausalLM", "Phi3Config", "Phi-3")}
"""Each family's causal LM class, config class and name, in transformers."""

FLOAT32_NORMS = ("gemma", "gemma3_text")
"""Families whose RMSNorm computes in float32 whatever the model's dtype (Gemma's ``x.float()``): a float64 run
equals one process to float32's rounding of their gradients' sums, not to 1e-10."""

FAMILIES = tuple(_CLASSES)
"""The Hugging Face ``model_type`` values fourfold has a plan and a split for; all but GPT-2 are Llama-shaped."""


def causal_lm_class(family: str) -> Any:
    """The transformers class of ``family``'s causal LM (``LlamaForCausalLM``, ...)."""
    import transformers

    return getattr(transformers, _CLASSES[family][0])


def hf_family(model: nn.Module) -> str | None:
    """The family (:data:`FAMILIES`) of a Hugging Face causal LM fourfold has a plan for, else None."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    return kind if kind in FAMILIES and hasattr(model, "lm_head") else None


def meta_kwargs(model: nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments to call ``model`` with on ``ids``: for a Hugging Face model on the ``meta`` device
    (shapes only: FLOPs and activations counted for a model this machine cannot hold) its causal mask, 4-D;
    none otherwise. transformers reads values to build that mask (a packed-sequence test on the positions, a
    padding test on a 2-D mask), which meta tensors have none of; given the mask itself it reads none, and the
    attention it runs is the same."""
    if ids.device.type != "meta" or hf_family(model) is None:
        return {}
    t = ids.size(-1)
    return {"attention_mask": torch.ones(1, 1, t, t, dtype=torch.bool, device=ids.device).tril()}


def prepare(model: nn.Module) -> None:
    """Training needs no key/value cache: switch it off, so no forward builds one. Packed documents are kept
    apart (:func:`read_documents`)."""
    config: Any = model.config
    config.use_cache = False
    read_documents(model)


def plan(model: nn.Module) -> dict[str, str] | Callable[..., nn.Module]:
    """The model's tensor-parallel plan: fourfold's for GPT-2, the model's own (``tp_plan``) for the others;
    Gemma's applied around its scaled embedding (:func:`_scaled_embedding_plan`)."""
    if hf_family(model) == "gpt2":
        return dict(GPT2_PLAN)
    carried = dict(getattr(model, "tp_plan", None) or {})
    if not carried:
        raise ValueError(f"tensor parallelism needs a plan, got a {type(model).__name__} carrying none "
                         "(model.tp_plan is empty). Pass tp_plan={'module.path': 'column' | 'row' | ...}")
    if hf_family(model) in ("gemma", "gemma3_text"):
        return functools.partial(_scaled_embedding_plan, carried)
    if hf_family(model) == "phi3":
        return {**carried, **fused_plan(model.config)}
    return carried


def fused_plan(config: Any) -> dict[str, str]:
    """Phi-3's fused projections split as Megatron splits them. Its own plan gathers ``qkv_proj`` and
    ``gate_up_proj`` whole on every rank (``colwise_gather_output``) because its forward slices them; here each
    rank takes its heads of q, of k and of v (``column:<q>,<kv>,<kv>``, in heads) and its slice of gate and of
    up (``column:2``), so attention and the MLP run on this rank's part only, as Llama's separate projections do.
    The attention's slicing then reads this rank's head counts (:func:`shard_fixups`)."""
    q, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    layers = "model.layers.*"
    return {f"{layers}.self_attn.qkv_proj": f"column:{q},{kv},{kv}", f"{layers}.self_attn.o_proj": "row",
            f"{layers}.mlp.gate_up_proj": "column:2", f"{layers}.mlp.down_proj": "row"}


def _scaled_embedding_plan(carried: dict[str, str], model: nn.Module, group: Any, *, sequence_parallel: bool,
                           tracer: Any) -> nn.Module:
    """Gemma's plan: its token embedding multiplies what it looks up by ``embed_scale`` (sqrt(hidden_size)), in a
    subclass of ``nn.Embedding`` the vocabulary-parallel style does not take as it is. The table is sharded as a
    plain embedding's (tied to the head still), and the scale applied to the summed lookup, as Gemma's does."""
    from fourfold.parallel.tensor import tensor_parallel

    if sequence_parallel:
        raise ValueError("sequence_parallel needs a model-family plan that runs its non-parallel parts on sequence "
                         "shards, got Gemma's {module: style} plan. Drop sequence_parallel.")
    scaled: Any = model.get_submodule("model.embed_tokens")
    plain = nn.Embedding(scaled.num_embeddings, scaled.embedding_dim, scaled.padding_idx, device="meta",
                         dtype=scaled.weight.dtype)
    plain.weight = scaled.weight  # the same parameter: the head's tie holds
    model.get_submodule("model").embed_tokens = plain
    out = tensor_parallel(model, carried, group, tracer=tracer)
    out.get_submodule("model.embed_tokens").register_forward_hook(functools.partial(_scale, scaled.embed_scale))
    return out


def _scale(scale: torch.Tensor, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * scale.to(output.dtype)  # as GemmaTextScaledWordEmbedding: the scale in the table's dtype


def shard_fixups(model: nn.Module, tp: int) -> None:
    """After sharding: GPT-2's attention splits its c_attn output by ``split_size``, now C/tp per part; Phi-3's
    slices its qkv_proj output by the config's head counts, which each attention now reads as this rank's."""
    family = hf_family(model)
    module: Any
    for module in model.modules():
        if family == "gpt2" and hasattr(module, "split_size") and hasattr(module, "c_attn"):
            module.split_size //= tp
            module.num_heads //= tp
        elif family == "phi3" and isinstance(getattr(module, "qkv_proj", None), ColumnParallelLinear) \
                and not isinstance(module.config, _RankHeads):  # split by the plan, and not already fixed
            module.config = _RankHeads(module.config, tp)
            module.num_key_value_heads //= tp


class _RankHeads:
    """A model's config as one tensor-parallel rank's attention reads it: its share of the query and key/value
    heads; every other attribute the model's own (read through, so a later ``set_attn_implementation`` on the model
    reaches it)."""

    def __init__(self, config: Any, tp: int) -> None:
        self._config = config
        self.num_attention_heads = config.num_attention_heads // tp
        self.num_key_value_heads = (config.num_key_value_heads or config.num_attention_heads) // tp

    def __getattr__(self, name: str) -> Any:
        if name == "_config":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._config, name)


def _sizes(config: Any) -> dict[str, tuple[int, str]]:
    """What tp must divide in ``config``, with what it means."""
    if config.model_type == "gpt2":
        inner = config.n_inner or 4 * config.n_embd
        return {"n_head": (config.n_head, "each rank computes whole attention heads"),
                "n_inner": (inner, "the MLP's hidden width is split"),
                "vocab_size": (config.vocab_size, "the embedding and head are split by vocabulary rows")}
    kv = config.num_key_value_heads or config.num_attention_heads
    return {"num_attention_heads": (config.num_attention_heads, "each rank computes whole attention heads"),
            "num_key_value_heads": (kv, "each rank needs whole key/value heads for its query heads"),
            "intermediate_size": (config.intermediate_size, "the MLP's hidden width is split"),
            "vocab_size": (config.vocab_size, "the embedding and head are split by vocabulary rows")}


def check_supported(config: Any) -> None:
    """Refuse, before any process starts, a config fourfold would run otherwise than it says: attention that
    looks both ways (Gemma 3's ``use_bidirectional_attention``, for embedding models: fourfold trains causal LMs,
    and its pipeline's and packing's masks are causal), or soft-capped attention scores (Gemma 3's
    ``attn_logit_softcapping``: fourfold runs attention with SDPA, which has no cap)."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{config.model_type} use_bidirectional_attention must be false (fourfold trains causal "
                         "language models: next-token loss, causal masks), got true. Set "
                         "\"use_bidirectional_attention\": false in the config")
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        raise ValueError(f"{config.model_type} attn_logit_softcapping must be null (fourfold runs attention with "
                         f"SDPA, which does not cap the scores; eager attention would misread fourfold's masks), got "
                         f"{cap}. Set \"attn_logit_softcapping\": null in the config")


def check_tp(config: Any, tp: int) -> None:
    """Refuse a tp the model's shapes cannot be split by (before any process starts, when called by the CLI)."""
    if tp <= 1 or getattr(config, "model_type", None) not in FAMILIES:
        return
    for name, (n, why) in _sizes(config).items():
        if n % tp:
            fits = [d for d in range(1, n + 1) if n % d == 0 and d <= 64]
            raise ValueError(f"{config.model_type} {name} must be divisible by tp ({why}), got {name}={n} and "
                             f"tp={tp}. Use tp in {fits}, or a config whose {name} tp divides")


_READING: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose forward reads the layout already


def read_documents(model: nn.Module) -> None:
    """Make the whole model keep packed documents apart: while a layout is current (the engine sets it), its
    forward gets the layout's ``position_ids`` (B, T) and block-diagonal causal mask as a 4-D
    ``attention_mask`` (B, 1, T, T), which transformers passes to SDPA as it is. The pipeline's pieces below
    read the layout themselves."""
    if model not in _READING:
        model.register_forward_pre_hook(_documents_kwargs, with_kwargs=True)
        _READING.add(model)


def check_attention(model: nn.Module, needs: str) -> None:
    """Refuse a model whose attention would misread fourfold's masks, which ``needs`` (a pipeline, packed
    documents) passes its layers: boolean, True where a token may attend, as SDPA reads them. Eager attention adds
    the mask to the scores instead (True is 1, False 0: every token attends everywhere, silently)."""
    used = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if used not in (None, "sdpa"):
        raise ValueError(f"{needs} passes the model's layers fourfold's boolean attention masks, which SDPA reads "
                         f"as masks, got a model with attn_implementation={used!r}"
                         + (" (it adds a mask to the scores: every token would attend everywhere)"
                            if used == "eager" else "") + ". Build it with attn_implementation='sdpa' "
                         "(from_pretrained(..., attn_implementation='sdpa')), or call "
                         "model.set_attn_implementation('sdpa') before parallelize.")


def _documents_kwargs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    layout = current_layout()
    if layout is None:
        return None
    check_attention(module, "a packed batch")
    config = getattr(module, "config", None)
    mask: Any = layout.mask
    window = sliding_window(config)
    if window is not None and getattr(config, "model_type", None) in PER_LAYER_WINDOWS:  # a mask per kind of layer
        mask = {kind: windowed(mask, window if kind == "sliding_attention" else None, mask.size(-1), mask.device)
                for kind in set(config.layer_types)}  # type: ignore[union-attr]
    else:  # Mistral: every layer (no window: the mask as it is)
        mask = windowed(mask, window, mask.size(-1), mask.device)
    return args, {**kwargs, "position_ids": layout.positions, "attention_mask": mask}


def _mask() -> torch.Tensor | None:
    layout = current_layout()
    return layout.mask if layout is not None else None


def _gpt2_before(m: Any, ids: torch.Tensor) -> torch.Tensor:
    t = m.transformer
    return t.drop(t.wte(ids) + t.wpe(position_ids(ids)))


def _gpt2_block(m: Any, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    out = layer(h, attention_mask=_mask())
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

PER_LAYER_WINDOWS = ("qwen2", "qwen3", "gemma3_text")
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
    window = sliding_window(getattr(attention, "config", None), getattr(attention, "layer_idx", None))
    pos = position_ids(h)
    pos = pos.unsqueeze(0) if pos.dim() == 1 else pos  # (1, T), or (B, T) restarting at each packed document
    rotary = m.model.rotary_emb  # (cos, sin): no parameters; Gemma 3's, a frequency per kind of layer
    rope = rotary(h, pos, attention.layer_type) if hasattr(rotary, "layer_types") else rotary(h, pos)
    return layer(h, attention_mask=windowed(_mask(), window, h.size(1), h.device), position_embeddings=rope,
                 position_ids=pos)


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
    Gemma 3's ``final_logit_softcapping`` (the split check would refuse a split that left them out)."""
    config = getattr(model, "config", None)
    multiplier = getattr(config, "embedding_multiplier", None)
    divisor, cap = getattr(config, "logits_scaling", None), getattr(config, "final_logit_softcapping", None)
    before = _llama_before if multiplier is None else functools.partial(_scaled_before, float(multiplier))
    after = _llama_after if divisor is None and cap is None else functools.partial(
        _scaled_after, None if divisor is None else float(divisor), None if cap is None else float(cap))
    return Split(blocks="model.layers", before=before, block=_llama_block, after=after)


class Sizes(NamedTuple):
    """What a family's config says of the model's size, under one set of names."""

    label: str
    vocab_size: int
    layers: int
    positions: int


def sizes(config: Any) -> Sizes:
    """GPT-2's ``n_layer`` / ``n_positions`` and the others' ``num_hidden_layers`` / ``max_position_embeddings``."""
    label = _CLASSES[config.model_type][2]
    if config.model_type == "gpt2":
        return Sizes(label, config.vocab_size, config.n_layer, config.n_positions)
    return Sizes(label, config.vocab_size, config.num_hidden_layers, config.max_position_embeddings)


def examples(model: nn.Module) -> list[torch.Tensor]:
    """Two id batches differing in batch size and length (random ids, from a generator of their own)."""
    config: Any = model.config
    T = max(2, min(sizes(config).positions, 16))
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(config.vocab_size, (1, T), generator=gen).to(device),
            torch.randint(config.vocab_size, (2, T - 1), generator=gen).to(device)]


def build_hf(family: str, config_path: str | os.PathLike[str] | None = None, *, seed: int = 0,
             dtype: torch.dtype = torch.float32, overrides: dict[str, Any] | None = None,
             filled: bool = True) -> nn.Module:
    """A freshly initialised causal LM of ``family`` (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...) from a JSON
    config (the keys of ``GPT2Config``, ``LlamaConfig``, ...); no weights are downloaded. Its weights are made
    layer by layer from ``seed`` by the family's own initialisation (:func:`seeded`), so every rank, and one
    process, builds the same model. ``filled=False``: its parameters are zeros in memory untouched until written
    (:func:`~fourfold.models.weights.zero_pages`), to be filled once a layout has cut it, each rank making only
    what it keeps (``engine.load_state_dict(seeded(model, seed))``, or stored weights). Under
    ``torch.device("meta")`` (shapes only) nothing is made."""
    from fourfold.models.weights import empty_parameters, fill, zero_pages

    config = hf_config(family, config_path, overrides)
    with empty_parameters():  # nothing drawn or allocated yet: the rotary frequencies, computed, are kept
        model = causal_lm_class(family)(config).to(dtype)
    model.set_attn_implementation("sdpa")  # fourfold's masks are boolean (True: attend), as sdpa reads them
    prepare(model)
    if torch.get_default_device().type == "meta":
        return model
    zero_pages(model)
    return fill(model, seeded(model, seed)) if filled else model


def seeded(model: nn.Module, seed: int) -> Any:
    """A Hugging Face model's first weights from ``seed``, a decoder layer (or the embedding, the final norm, the
    head) at a time (:class:`~fourfold.models.seeded.SeededInit`, its own ``_init_weights``), for ``model`` built
    as :func:`build_hf` builds it, before anything cuts it."""
    from fourfold.models.seeded import SeededInit

    blocks = (gpt2_split if hf_family(model) == "gpt2" else llama_split)(model).blocks
    assert isinstance(blocks, str)
    # transformers' per-module initialisation hook (what a family overrides, and what post_init applies to every
    # module, children first): the pinned transformers' own rule, not a copy of it
    init: Any = model._init_weights
    return SeededInit(model, seed, blocks=blocks, init=init)


def hf_config(family: str, config_path: str | os.PathLike[str] | None = None,
              overrides: dict[str, Any] | None = None) -> Any:
    """The family's config from a JSON file (and ``overrides``), read without building the model."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"--model {family} needs Hugging Face transformers, got none installed. Install it "
                         "with: pip install 'fourfold[hf]'") from None
    if family not in FAMILIES:
        raise ValueError(f"model family must be one of {', '.join(FAMILIES)}, got {family!r}.")
    from fourfold.models.build import read_model_config

    values = {**read_model_config(config_path), **(overrides or {})}
    cls = getattr(transformers, _CLASSES[family][1])
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # GPT-2's default ids past a small vocabulary: fixed below
    try:
        config = cls(**values)
    finally:
        transformers.logging.set_verbosity(verbosity)
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):  # GPT-2's 50256 past a small vocabulary
        tid = getattr(config, token, None)
        if isinstance(tid, int) and tid >= config.vocab_size:
            setattr(config, token, None)
    check_supported(config)
    return config
