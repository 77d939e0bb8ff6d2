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
  pipeline's pieces, packed documents) the window is in it too (:func:`~fourfold.models.hf_split.windowed`).
* **Gemma** (``GemmaForCausalLM``): Llama's layout with an embedding scaled by sqrt(hidden_size) and norms
  computed in float32 (:data:`FLOAT32_NORMS`).
* **Gemma 3** (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``: the text-only models, Gemma 3 1B's and
  the language model of the larger ones): Gemma's embedding and norms, Qwen3's per-head q/k norms, a window on the
  layers its ``layer_types`` mark, rotary frequencies per kind of layer (the pipeline's pieces ask for the
  layer's own), and logits soft-capped where ``final_logit_softcapping`` is set (the last piece caps them too).
* **Gemma 2** (``Gemma2ForCausalLM``): Gemma 3's layout without the q/k norms and with one rotary frequency, its
  attention scores soft-capped (``attn_logit_softcapping``), which SDPA does not compute: it runs eager attention,
  which fourfold gives its masks as it reads them (:func:`~fourfold.models.hf_split.as_read`), as does a Gemma 3
  whose scores are capped.
* **OLMo 2, OLMo 3** (``Olmo2ForCausalLM``, ``Olmo3ForCausalLM``): Llama's layout with norms after attention and
  the MLP instead of before, and q/k norms over all heads at once. transformers' own plan gathers q, k and v whole
  on every rank for them; fourfold's keeps the heads split and takes the norms' mean square over the ranks
  (:func:`~fourfold.models.hf_plan.qk_norm_plan`, plan style ``norm``). OLMo 3 adds a window on the layers its
  ``layer_types`` mark, with rotary frequencies per kind of layer.
* **SmolLM3** (``SmolLM3ForCausalLM``): Llama's layout with no rotary embedding on the layers ``no_rope_layers``
  marks 0 (each attention applies it or not), and, with ``use_sliding_window``, a window on those layers.
* **Granite** (``GraniteForCausalLM``): Llama's layout with multipliers: the embedding's, each residual
  branch's, the attention scores' (inside the layers), and the logits divided by ``logits_scaling`` (the
  pipeline's first and last pieces scale as its forward does).
* **Phi-3** (``Phi3ForCausalLM``, also Phi-4-mini's architecture): Llama's layout with fused projections, q|k|v in
  ``qkv_proj`` and gate|up in ``gate_up_proj``, each split block by block
  (:func:`~fourfold.models.hf_plan.fused_plan`), and Mistral's window on every layer.

What a family is lives here (its classes, config, checks, sizes, and its first weights: :func:`build_hf`,
:func:`seeded`); how tensor parallelism cuts it in :mod:`fourfold.models.hf_plan`, how a pipeline splits it and
which masks its attention gets in :mod:`fourfold.models.hf_split`. Their public names are importable from here.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from fourfold.models.hf_plan import GPT2_PLAN, block_sites, fused_plan, plan, shard_fixups
from fourfold.models.hf_split import (
    EVERY_LAYER_WINDOWS,
    PER_LAYER_WINDOWS,
    READS_MASKS,
    as_read,
    check_attention,
    family_split,
    gpt2_split,
    llama_split,
    read_documents,
    sliding_window,
    windowed,
)

if TYPE_CHECKING:
    from fourfold.models.seeded import SeededInit

__all__ = ["read_model_config", "ALSO_CALLED", "RELATED", "EAGER_ONLY", "EVERY_LAYER_WINDOWS", "FAMILIES", "FLOAT32_NORMS", "GPT2_PLAN",
           "PER_LAYER_WINDOWS", "READS_MASKS", "Sizes", "as_read", "attention_implementation", "block_sites", "build_hf",
           "causal_lm_class", "check_attention", "check_supported", "check_tp", "examples", "family_split",
           "fused_plan", "gpt2_split", "hf_config", "hf_family", "llama_split", "meta_kwargs", "named_like", "plan",
           "prepare", "read_documents", "seeded", "shard_fixups", "sizes", "sliding_window", "windowed"]


_CLASSES = {"gpt2": ("GPT2LMHeadModel", "GPT2Config", "GPT-2"), "llama": ("LlamaForCausalLM", "LlamaConfig", "Llama"),
            "mistral": ("MistralForCausalLM", "MistralConfig", "Mistral"),
            "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", "Qwen2"), "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", "Qwen3"),
            "gemma": ("GemmaForCausalLM", "GemmaConfig", "Gemma"),
            "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", "Gemma 2"),
            "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextConfig", "Gemma 3"),
            "granite": ("GraniteForCausalLM", "GraniteConfig", "Granite"),
            "phi3": ("Phi3ForCausalLM", "Phi3Config", "Phi-3"),
            "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", "OLMo 2"),
            "olmo3": ("Olmo3ForCausalLM", "Olmo3Config", "OLMo 3"),
            "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", "SmolLM3")}
"""Each family's causal LM class, config class and name, in transformers."""


FLOAT32_NORMS = ("gemma", "gemma2", "gemma3_text", "olmo2", "olmo3")
"""Families whose RMSNorm computes in float32 whatever the model's dtype (Gemma's ``x.float()``, OLMo's
``to(torch.float32)``): a float64 run equals one process to float32's rounding of their gradients' sums, not to
1e-10."""


FAMILIES = tuple(_CLASSES)
"""The Hugging Face ``model_type`` values fourfold has a plan and a split for; all but GPT-2 are Llama-shaped."""


ALSO_CALLED = {"llama2": "llama", "llama3": "llama", "llama31": "llama", "llama32": "llama", "qwen25": "qwen2",
               "phi4": "phi3", "phi4mini": "phi3", "gemma3": "gemma3_text"}
"""Names people give a family's models that are not its transformers ``model_type`` (punctuation ignored)."""


def named_like(given: str, names: tuple[str, ...]) -> str | None:
    """The one family ``given`` names otherwise (``Phi-3`` -> phi3, ``llama3`` -> llama, ``gemma3`` ->
    gemma3_text), else None: no guess between architectures (mixtral is not mistral, gemma4 not gemma3_text)."""
    def plain(s: str) -> str:
        return "".join(c for c in s.lower() if c.isalnum())

    key = plain(given)
    exact = [n for n in names if plain(n) == key]
    return exact[0] if exact else ALSO_CALLED.get(key)


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
    apart (:func:`~fourfold.models.hf_split.read_documents`)."""
    config: Any = model.config
    config.use_cache = False
    read_documents(model)


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
    looks both ways (Gemma 2's and Gemma 3's ``use_bidirectional_attention``, for embedding models: fourfold
    trains causal LMs, and its pipeline's and packing's masks are causal)."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{config.model_type} use_bidirectional_attention must be false (fourfold trains causal "
                         "language models: next-token loss, causal masks), got true. Set "
                         "\"use_bidirectional_attention\": false in the config")


EAGER_ONLY = ("gemma2",)
"""Families whose transformers class runs no SDPA (Gemma 2's, whose scores are soft-capped by default)."""


def attention_implementation(config: Any) -> str:
    """How :func:`build_hf` runs a family's attention: SDPA, or eager attention where the scores are soft-capped
    (a Gemma 3's ``attn_logit_softcapping``, if set), which SDPA does not compute, and for the families whose class
    runs no SDPA (:data:`EAGER_ONLY`). Eager attention computes the whole (T, T) score matrix in memory, as
    transformers' own Gemma 2 does."""
    capped = getattr(config, "attn_logit_softcapping", None) is not None
    return "eager" if capped or config.model_type in EAGER_ONLY else "sdpa"


def check_tp(config: Any, tp: int) -> None:
    """Refuse a tp the model's shapes cannot be split by (before any process starts, when called by the CLI)."""
    if tp <= 1 or getattr(config, "model_type", None) not in FAMILIES:
        return
    for name, (n, why) in _sizes(config).items():
        if n % tp:
            fits = [d for d in range(1, n + 1) if n % d == 0 and d <= 64]
            raise ValueError(f"{config.model_type} {name} must be divisible by tp ({why}), got {name}={n} and "
                             f"tp={tp}. Use tp in {fits}, or a config whose {name} tp divides")


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
    """Two id batches differing in batch size and length (random ids, from a generator of their own): T, a power
    of two, and T/2, far enough apart to differ still when cut to a multiple of tp for sequence parallelism."""
    config: Any = model.config
    T = 1 << max(1, min(sizes(config).positions, 16).bit_length() - 1)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(config.vocab_size, (1, T), generator=gen).to(device),
            torch.randint(config.vocab_size, (2, T // 2), generator=gen).to(device)]


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
    model.set_attn_implementation(attention_implementation(config))  # either reads fourfold's masks (as_read)
    prepare(model)
    if torch.get_default_device().type == "meta":
        return model
    zero_pages(model)
    return fill(model, seeded(model, seed)) if filled else model


def seeded(model: nn.Module, seed: int) -> SeededInit:
    """A Hugging Face model's first weights from ``seed``, a decoder layer (or the embedding, the final norm, the
    head) at a time (:class:`~fourfold.models.seeded.SeededInit`, its own ``_init_weights``), for ``model`` built
    as :func:`build_hf` builds it, before anything cuts it."""
    from fourfold.models.seeded import SeededInit

    blocks = family_split(model).blocks
    assert isinstance(blocks, str)
    # transformers' per-module initialisation hook (what a family overrides, and what post_init applies to every
    # module, children first): the pinned transformers' own rule, not a copy of it
    init: Any = model._init_weights
    return SeededInit(model, seed, blocks=blocks, init=init)


@functools.cache
def config_keys(cls: type) -> frozenset[str]:
    """The keys a transformers config class reads: its ``__init__``'s parameters, a default instance's attributes
    (the common ones every config has) and its ``attribute_map`` aliases (GPT-2's ``hidden_size``)."""
    params = {n for n, p in inspect.signature(cls).parameters.items() if p.kind is not p.VAR_KEYWORD}
    return frozenset(params | set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))) - {"self"}


RELATED = {"qwen3": ("qwen3_moe", "Qwen3MoeConfig"), "qwen2": ("qwen2_moe", "Qwen2MoeConfig"),
           "mistral": ("mixtral", "MixtralConfig"), "phi3": ("phi", "PhiConfig"), "olmo2": ("olmoe", "OlmoeConfig")}
"""Each family's look-alike, whose keys in a config without ``model_type`` mean the file is the other model's:
a dense Qwen3 built from Qwen3-MoE's keys would drop its experts silently (its class ignores them)."""


def _check_family(family: str, cls: type, values: dict[str, Any], path: str | os.PathLike[str] | None) -> None:
    """Refuse a config without ``model_type`` that holds keys only the family's look-alike reads (:data:`RELATED`),
    naming the keys and the model they belong to."""
    import transformers

    if family not in RELATED:
        return
    other_type, other_name = RELATED[family]
    other = getattr(transformers, other_name, None)
    if other is None:
        return
    theirs = sorted(k for k in values if k in config_keys(other) - config_keys(cls))
    if theirs:
        where = f" in {str(path)!r}" if path is not None else ""
        raise ValueError(f"model_config holds {', '.join(map(repr, theirs))}{where}, keys of {other_type} (a "
                         f"{other_name[:-6]}), which a {family} model ignores: it would be built without them "
                         f"(a dense {family}), not the model the file describes. fourfold has no plan for "
                         f"{other_type} yet (issue 49); pass a {family} config, or drop those keys knowingly.")


def _check_keys(cls: type, values: dict[str, Any], path: str | os.PathLike[str] | None) -> None:
    """A key the config class does not read is kept as an attribute and ignored: refused where it is a misspelling
    of one it reads (``n_layr``: a 12-layer default GPT-2, silently). Other unknown keys pass: Hugging Face's own
    config.json files carry keys older versions read (``n_ctx``, ``rope_theta``, ``torch_dtype``)."""
    known = config_keys(cls)
    typos = {k: near[0] for k in values if k not in known
             and (near := difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.8))}
    if typos:
        where = f" in {str(path)!r}" if path is not None else ""
        got = ", ".join(f"{k!r} (did you mean {v!r}?)" for k, v in typos.items())
        raise ValueError(f"model_config's keys must be {cls.__name__}'s, got {got}{where}: {cls.__name__} would "
                         f"ignore {'them' if len(typos) > 1 else 'it'} and keep its defaults. Fix the "
                         f"key{'s' if len(typos) > 1 else ''}.")


def read_model_config(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """``--model-config``: a JSON object (a Hugging Face config's keys, or a factory's keyword arguments)."""
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8-sig") as f:
            values = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model_config must be a readable JSON file, got {str(path)!r}: {e}. Write the keys "
                         "as one JSON object (see docs/your-model.md)") from None
    if not isinstance(values, dict):
        raise ValueError(f"model_config must hold a JSON object, got {type(values).__name__} in {str(path)!r}.")
    return values


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
    values = {**read_model_config(config_path), **(overrides or {})}
    unnamed = "model_type" not in values
    named = values.pop("model_type", family)  # a config.json says which architecture it is: it must be this one
    if named != family:
        near = named_like(str(named), FAMILIES) if named not in FAMILIES else named
        fix = f"Pass --model {near}" if near else "fourfold has no plan or split for it: use a family it has"
        raise ValueError(f"model_config must be a {family} config (its model_type), got model_type={named!r} in "
                         f"{str(config_path)!r}. {fix}, or a config of the model you name.")
    cls = getattr(transformers, _CLASSES[family][1])
    if unnamed:  # no model_type: the keys say whose config it is
        _check_family(family, cls, values, config_path)
    _check_keys(cls, values, config_path)
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
