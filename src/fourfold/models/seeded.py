"""A fresh Hugging Face model's first weights, made unit by unit, so that no rank makes the whole model to keep a
part of it.

transformers initialises a model in one pass over all its modules, drawing from torch's one global generator: the
values of layer 20 depend on how much layers 0..19 drew, so a rank that keeps layer 20 alone would have to draw
everything before it. fourfold cuts that chain. Each **unit** (a decoder layer, the token embedding, the final
norm, the head: every module outside the layers that holds parameters) is initialised by the model's own rule
(its ``_init_weights``, children first, as transformers applies it) from a generator seeded by the run's seed and
the unit's name alone::

    seeded = fourfold.models.hf.seeded(model, seed=0)   # model: built unfilled (build_hf(..., filled=False))
    engine = parallelize(model, mesh)
    engine.load_state_dict(seeded)                       # each rank makes the units it holds, and cuts them

A rank then makes only the units its pipeline stages hold (each whole while it takes its tensor-parallel piece;
a tied embedding twice where the head keeps a copy), and one process filling the whole model
(:func:`fourfold.models.hf.build_hf`, ``--verify``'s re-run) makes the same values: a layout starts where one
process starts. The distribution is transformers' own; the values are not those of ``cls(config)`` under
``torch.manual_seed(seed)``. (TinyGPT, small by design, draws its whole model from one generator of its own, so
its ranks build it whole: made by units, its values would change, and with them every figure measured on it.)
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable

import torch
from torch import nn

from fourfold.parallel.tensor.plan import LazyState

__all__ = ["SeededInit", "unit_of", "unit_seed"]


def unit_of(name: str, blocks: str) -> str:
    """The unit a parameter ``name`` is made with: its layer (``model.layers.3`` for
    ``model.layers.3.mlp.up_proj.weight``, ``blocks`` being ``model.layers``), else the module that holds it."""
    if name.startswith(blocks + "."):
        return ".".join(name.split(".")[:len(blocks.split(".")) + 1])
    return name.rpartition(".")[0]


def unit_seed(seed: int, unit: str) -> int:
    """The generator's seed for ``unit``: a function of the run's seed and the unit's name alone (not Python's
    ``hash``, which differs between processes)."""
    digest = hashlib.sha256(f"{seed}:{unit}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class SeededInit(LazyState):
    """``model``'s first weights by its state dict's names, each unit made when one of its tensors is asked for
    (:func:`unit_of`, :func:`unit_seed`; the last unit made is kept until another is asked for, or until the
    ``with`` block ends). ``model`` is the whole model, before anything cuts it: its units' shapes are copied (on
    the meta device) when this is made. ``init`` is the rule applied to each module of a unit, children first (a
    Hugging Face model's ``_init_weights``); ``blocks`` names the container of its layers. A tied weight is made
    with its first owner (the token embedding, not the head); the model's buffers are given as it holds them. A
    parameter ``init`` leaves unwritten is refused by name, not left as whatever memory held."""

    def __init__(self, model: nn.Module, seed: int, *, blocks: str, init: Callable[[nn.Module], None]) -> None:
        self.seed, self.blocks, self._init = seed, blocks, init
        first: dict[int, str] = {}
        self._owner = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
        state = model.state_dict(keep_vars=True)
        self._buffers = {n: b.detach() for n, b in model.named_buffers() if n in state}
        units = dict.fromkeys(unit_of(n, blocks) for n in self._owner.values())
        # every parameter of the model on the meta device, wherever a unit refers to it: no copy has memory
        memo: dict[int, object] = {
            id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
        self._shapes = {u: copy.deepcopy(model.get_submodule(u), dict(memo)) for u in units}
        self._made: tuple[str, dict[str, torch.Tensor]] | None = None
        super().__init__(state, self._tensor)

    def _tensor(self, name: str) -> torch.Tensor:
        if name in self._buffers:
            return self._buffers[name]
        owner = self._owner[name]
        unit = unit_of(owner, self.blocks)
        if self._made is None or self._made[0] != unit:
            self._made = (unit, self.make(unit))
        return self._made[1][owner[len(unit) + 1:] if unit else owner]

    @torch.no_grad()
    def make(self, unit: str) -> dict[str, torch.Tensor]:
        """The parameters of ``unit``, initialised, by their names inside it."""
        module = copy.deepcopy(self._shapes[unit])
        for m in module.modules():
            for pname, p in list(m.named_parameters(recurse=False)):
                unset = torch.full(p.shape, float("nan"), dtype=p.dtype, device="cpu")
                setattr(m, pname, nn.Parameter(unset, requires_grad=p.requires_grad))
        with torch.random.fork_rng(devices=[]):  # the CPU generator alone: it is put back, the devices' untouched
            torch.default_generator.manual_seed(unit_seed(self.seed, unit))
            module.apply(self._init)
        made = {n: p.detach() for n, p in module.named_parameters()}
        unset_names = [n for n, t in made.items() if t.is_floating_point() and bool(t.isnan().any())]
        if unset_names:
            raise ValueError(f"the model's initialisation must write every parameter of {unit!r}, got "
                             f"{', '.join(unit + '.' + n for n in unset_names[:4])} left unwritten. Give its "
                             "family's _init_weights a rule for that module, or start from stored weights "
                             "(--init-from).")
        return made

    def close(self) -> None:
        """Drop the unit kept from the last read (a whole embedding, say): nothing is held after the fill."""
        self._made = None

    def __enter__(self) -> SeededInit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

