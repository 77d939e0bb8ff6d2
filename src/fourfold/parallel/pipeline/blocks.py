"""Your own model as a chain of pieces, for pipeline and model parallelism: the blocks named by module path, the
work between them given as small functions, checked once against ``model(example)``.

    from fourfold import Split, parallelize
    split = Split(blocks="transformer.h",                             # a ModuleList, or a list of module paths
                  before=lambda m, ids: m.transformer.drop(m.transformer.wte(ids) + m.transformer.wpe(positions(ids))),
                  after=lambda m, h: m.lm_head(m.transformer.ln_f(h)))
    engine = parallelize(model, mesh, split=split, example=ids)      # pp >= 2: refused here if it is wrong

Each function gets ``m``: the model as its piece holds it, with only the modules the function calls, at their
paths in the model, so every piece's state dict uses the model's own names. ``block(m, layer, h)`` runs one
block (default: ``layer(h)``, the first element if it returns a tuple); use ``m`` for shared helpers
(Llama's ``m.model.rotary_emb``). Which modules a function needs is found by running it once on the example.

The check: the chain of pieces on the example must give ``model(example)`` (its ``.logits`` when it returns a
Hugging Face output). If not, the split is refused naming the first module, in the model's order, that the
pieces never call or whose output differs: ``nn.Sequential(wte, *h, ln_f, lm_head)`` of a GPT-2 is refused
naming ``transformer.wpe``, the position embedding it would silently train without.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Chain", "EvalMode", "Piece", "Split", "SplitError", "block_paths", "check_split", "output_tensor",
           "positions", "resolve_split"]

PieceFn = Callable[[nn.Module, torch.Tensor], Any]
BlockFn = Callable[[nn.Module, nn.Module, torch.Tensor], Any]


class SplitError(ValueError):
    """A split that does not reproduce the model: raised before training, naming the module and the fix."""


@dataclass(frozen=True)
class Split:
    """How ``model(x)`` runs as ``after(block_n(...block_1(before(x))))``: see the module's docstring.

    ``blocks``: the path of a ModuleList (``"transformer.h"``) or a ModuleDict (its values in order: torchtitan's
    ``layers``), or a list of module paths (a ModuleList or ModuleDict among them is expanded). ``before(m, x)``, ``block(m, layer, h)``, ``after(m, h)``: each returns one tensor.
    """

    blocks: str | Sequence[str]
    before: PieceFn | None = None
    block: BlockFn | None = None
    after: PieceFn | None = None

    @classmethod
    def sequential(cls, paths: Sequence[str]) -> Split:
        """The plain chain: each module in ``paths`` (ModuleLists expanded) applied to the last one's output."""
        return cls(blocks=tuple(paths))


def positions(x: torch.Tensor) -> torch.Tensor:
    """``arange(T)`` for a (B, T, ...) tensor, on its device: the positions of a sequence from its start."""
    return torch.arange(x.shape[1], device=x.device)


def output_tensor(out: Any) -> torch.Tensor:
    """The tensor a module's output stands for: itself, the first element of a tuple, ``.logits`` (Hugging
    Face's outputs) or a dict's ``"logits"``. An output carrying an ``aux_loss`` tensor (a mixture of experts'
    router loss: Qwen3-MoE, Mixtral with ``output_router_logits``) is refused: the logits alone are not its loss."""
    if isinstance(out, torch.Tensor):
        return out
    aux = out.get("aux_loss") if isinstance(out, Mapping) else getattr(out, "aux_loss", None)
    if isinstance(aux, torch.Tensor):
        raise ValueError(
            "the model returns an auxiliary loss beside its logits (aux_loss: a mixture of experts' router "
            "load-balancing term), which fourfold's loss, reading the logits only, would drop: it would train "
            "something other than the model's own loss without a word. Build it with output_router_logits=False "
            "(its config) to train without the term knowingly; training with it is not built yet")
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, Mapping) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    held = f" with keys {sorted(map(str, out))}" if isinstance(out, Mapping) else ""
    raise TypeError(f"a model (or a pipeline piece) must return a tensor, a tuple whose first element is one, a "
                    f"Hugging Face output or a dict with 'logits', got {type(out).__name__}{held}. Return the "
                    "logits (or a piece's hidden states) as one tensor, or under the key 'logits'")


class _Node(nn.Module):
    """A step of a module path inside a piece (``transformer`` in ``transformer.h.3``); ``node[3]`` reads child
    ``"3"``, as the ModuleList it stands for would."""

    def __getitem__(self, key: int | str) -> nn.Module:
        if str(key) not in self._modules:
            raise KeyError(f"this piece holds only {sorted(self._modules)} here, got {key!r}: a piece's function "
                           "may use only the modules it called when the split was checked")
        module = self._modules[str(key)]
        assert module is not None
        return module


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        child = node._modules.get(name)
        if child is None:
            child = _Node()
            node.add_module(name, child)
        node = child
    node.add_module(leaf, module)


class Piece(nn.Module):
    """One link of a :class:`Chain`: the modules at ``paths`` of the model, placed at those paths (so the state
    dict's keys are the model's), and the function that runs them. ``block``: the path of the block this piece
    runs, passed to ``fn(m, layer, h)``; None for ``before``/``after`` pieces, ``fn(m, x)``."""

    model_names = True  # the pipeline's Stage keeps this piece's state-dict keys as they are

    def __init__(self, label: str, modules: Sequence[tuple[str, nn.Module]], fn: Callable[..., Any],
                 block: str | None = None) -> None:
        super().__init__()
        self.label, self.paths, self.block = label, tuple(p for p, _ in modules), block
        for path, module in modules:
            _place(self, path, module)
        self._fn = fn

    __getitem__ = _Node.__getitem__  # m[0] in a function over an nn.Sequential reads child "0", as the model would

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block is not None:
            return output_tensor(self._fn(self, self.get_submodule(self.block), x))
        return output_tensor(self._fn(self, x))

    def extra_repr(self) -> str:
        return f"label={self.label!r}"


class Chain(nn.Module):
    """The pieces in order, ``forward`` = the model's; what the pipeline splitter cuts into stages."""

    def __init__(self, pieces: Sequence[Piece], examples: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)
        self._examples = list(examples)

    def named_blocks(self) -> list[tuple[str, nn.Module]]:
        return [(piece.label, piece) for piece in self.pieces if isinstance(piece, Piece)]

    def example_inputs(self) -> list[torch.Tensor]:
        return list(self._examples)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for piece in self.pieces:
            x = piece(x)
        return x


class PieceSpec(NamedTuple):
    """A piece before it is built: its label, the model paths it calls, its function, its block's path."""

    label: str
    paths: tuple[str, ...]
    fn: Callable[..., Any]
    block: str | None


def block_paths(model: nn.Module, blocks: str | Sequence[str]) -> list[str]:
    out = []
    for path in [blocks] if isinstance(blocks, str) else list(blocks):
        try:
            module = model.get_submodule(path)
        except AttributeError:
            tops = [n for n, _ in model.named_children()]
            raise SplitError(f"split names a module the model does not have, got {path!r}. Its top-level "
                             f"modules: {', '.join(tops)}; name blocks by their path, as model.named_modules() "
                             "does") from None
        if isinstance(module, nn.ModuleList):
            out += [f"{path}.{i}" if path else str(i) for i in range(len(module))]
        elif isinstance(module, nn.ModuleDict):  # torchtitan's layers: its forward runs them in insertion order
            out += [f"{path}.{key}" if path else key for key in module]
        else:
            out.append(path)
    if not out:
        raise SplitError(f"split must name at least one block, got blocks={blocks!r}.")
    return out


class _Recorder:
    """Forward hooks on every module of a model: the order modules are entered, and each one's first output."""

    def __init__(self, model: nn.Module) -> None:
        self.order: list[str] = []
        self.outputs: dict[str, torch.Tensor | None] = {}
        self._handles = []
        for name, module in model.named_modules():
            if name:
                self._handles.append(module.register_forward_pre_hook(self._enter(name)))
                self._handles.append(module.register_forward_hook(self._leave(name)))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if name not in self.outputs:
                self.order.append(name)
                self.outputs[name] = None
        return hook

    def _leave(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if self.outputs.get(name) is None:
                try:
                    self.outputs[name] = output_tensor(out).detach().clone()
                except TypeError:
                    pass
        return hook

    def clear(self) -> None:
        self.order, self.outputs = [], {}

    def called(self) -> list[str]:
        """The outermost modules entered: a module inside another that was entered is covered by it."""
        entered = set(self.order)
        return [n for n in self.order if not any(n.startswith(a + ".") for a in entered if a != n)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class EvalMode:
    """Dropout off for a check on an example, and every module's training flag put back after."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.modes = model, [(m, m.training) for m in model.modules()]

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        for m, mode in self.modes:
            m.training = mode


def _default_block(m: nn.Module, layer: nn.Module, h: torch.Tensor) -> Any:
    return layer(h)


def _apply(module: nn.Module, x: torch.Tensor) -> Any:
    return module(x)


@torch.no_grad()
def resolve_split(model: nn.Module, split: Split, example: torch.Tensor) -> list[PieceSpec]:
    """Which modules each piece of ``split`` calls (found by running it once on ``example``), checked by
    :func:`check_split`: refused with :class:`SplitError` unless the chain reproduces ``model(example)``."""
    paths = block_paths(model, split.blocks)
    block_fn = split.block or _default_block
    rec = _Recorder(model)
    specs: list[PieceSpec] = []
    try:
        with EvalMode(model):
            h = example

            def run(label: str, fn: Callable[..., Any], *args: Any, block: str | None = None,
                    own: str | None = None) -> torch.Tensor:
                rec.clear()
                try:
                    out = output_tensor(fn(model, *args))
                except SplitError:
                    raise
                except Exception as e:
                    raise SplitError(f"split piece {label!r} fails on the example: {type(e).__name__}: {e}. "
                                     "Check that it takes the previous piece's output") from e
                called = rec.called()
                if not called:
                    raise SplitError(f"split piece {label!r} calls no module of the model. Call the model's "
                                     "modules in it (m.transformer.wte(ids)), or fold it into its neighbour")
                target = block or own  # the module the piece names: by that path, not by an alias of it
                if target is not None:  # (a module at several paths is recorded under its first)
                    module = model.get_submodule(target)
                    called = [n for n in called if n == target or model.get_submodule(n) is not module]
                    if target not in called:
                        called.insert(0, target)
                specs.append(PieceSpec(label, tuple(called), fn, block))
                return out

            if split.before is not None:
                h = run("before", split.before, h)
            for path in paths:
                if split.block is None and split.before is None and split.after is None:  # the plain chain
                    h = run(path, lambda m, x, p=path: _apply(m.get_submodule(p), x), h, own=path)
                else:
                    h = run(path, block_fn, model.get_submodule(path), h, block=path)
            if split.after is not None:
                run("after", split.after, h)
    finally:
        rec.remove()
    for i, spec in enumerate(specs):
        if spec.label in ("before", "after"):
            specs[i] = spec._replace(label="+".join(spec.paths))
    check_split(model, specs, example)
    return specs


def _uncalled(model: nn.Module, label: str, e: Exception) -> str:
    """Why piece ``label`` failed to find something of the model (a piece holds only the modules it called)."""
    found = re.search(r"has no attribute '(\w+)'", str(e))
    name = found.group(1) if found else None
    buffers, params = dict(model.named_buffers(recurse=False)), dict(model.named_parameters(recurse=False))
    if name in buffers or name in params:  # a tensor on the root module: no piece holds the root
        kind = "buffer" if name in buffers else "parameter"
        return (f"split piece {label!r} reads the model's {kind} {name!r}, which sits on the root module, and a "
                "piece holds only the submodules it calls: every parameter and buffer a piece needs must live in a "
                "submodule. Move it into one (a small nn.Module that holds it and applies it, called in the piece)")
    return (f"split piece {label!r} uses a module it did not call when its modules were found: {e}. Call "
            "modules (m.lm_head(h)) rather than reading their weights")


def build_pieces(model: nn.Module, specs: Sequence[PieceSpec]) -> list[Piece]:
    """The pieces of ``specs`` over ``model``'s modules as they are now (after tensor parallelism swapped some)."""
    return [Piece(s.label, [(p, model.get_submodule(p)) for p in s.paths], s.fn, s.block) for s in specs]


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal within float32 rounding; shapes that differ only by leading 1s (``wpe(arange(T))`` against the
    model's ``wpe(position_ids[None])``) compare as the model would broadcast them."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape:
        if a.numel() != b.numel() or [d for d in a.shape if d != 1] != [d for d in b.shape if d != 1]:
            return False
        a = a.reshape(b.shape)
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    return bool(torch.allclose(a.to(b.dtype), b, rtol=1e-4, atol=1e-4 * scale))


@torch.no_grad()
def check_split(model: nn.Module, specs: Sequence[PieceSpec], example: torch.Tensor) -> None:
    """Refuse (:class:`SplitError`) a chain of pieces that does not give ``model(example)``, naming the first
    module in the model's order the pieces never call, or whose output differs."""
    rec = _Recorder(model)
    try:
        with EvalMode(model):
            want = output_tensor(model(example))
            ref_order, ref = list(rec.order), dict(rec.outputs)
            rec.clear()
            pieces = build_pieces(model, specs)
            x = example
            for piece in pieces:
                try:
                    x = piece(x)
                except (AttributeError, KeyError) as e:
                    raise SplitError(_uncalled(model, piece.label, e)) from e
            got, chain = x, dict(rec.outputs)
    finally:
        rec.remove()
    if _close(got, want):
        return
    diff = "shape " + str(tuple(got.shape)) if got.shape != want.shape else \
        f"max |difference| {float((got.to(want.dtype) - want).abs().max()):.3g}"
    for name in ref_order:
        if name not in chain:
            if any(c.startswith(name + ".") for c in chain):
                continue  # a container the pieces call into, not as a whole
            raise SplitError(f"the split does not reproduce model(example) ({diff}): {name} "
                             f"({type(model.get_submodule(name)).__name__}) runs in the model's forward but in "
                             "no piece. Call it in the piece where the model does (a `before`/`after` "
                             "function of fourfold.Split)")
        if not _close(chain[name], ref[name]):
            raise SplitError(f"the split does not reproduce model(example) ({diff}): the first module whose "
                             f"output differs is {name} ({type(model.get_submodule(name)).__name__}). Check "
                             "what the pieces feed it, against the model's forward")
    raise SplitError(f"the split does not reproduce model(example) ({diff}), though every module gives the "
                     "model's output: the difference is in the pieces' own arithmetic. Check the functions "
                     "against the model's forward")
