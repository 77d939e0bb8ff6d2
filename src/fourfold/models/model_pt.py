"""``model.pt``: a run's final weights in one file that proves itself.

The file is a plain ``torch.save`` of ``{"model": state dict, "config": ..., "step": ..., "format": 2,
"sha256": ...}`` (``torch.load(..., weights_only=True)`` reads it anywhere). ``sha256`` is taken over every
tensor's name, dtype, shape and bytes, and the config and step, when the file is written; :func:`read` takes it
again and refuses a file whose weights are not the ones written. torch's own reader notices a damaged container
but not a flipped byte inside a tensor, which loaded without a word before; an empty, truncated, random or text
file raised torch's own error (``EOFError``, ``pop from empty list``, a note on ``weights_only``), now one line
naming the file, what is wrong and what to do. A ``model.pt`` written before the digest (no ``format``) still
loads, unchecked. ``fourfold export``'s ``model.safetensors`` carries the same digest in its metadata
(:data:`SAFETENSORS_KEY`), checked when ``--init-from`` reads it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fourfold.files import atomic_path

__all__ = ["FORMAT", "SAFETENSORS_KEY", "WeightsFileError", "check", "check_tensors", "read", "weights_sha256", "write"]

FORMAT = 2
"""2: with ``sha256``. (1, unmarked: before it.)"""


class WeightsFileError(ValueError):
    """A ``model.pt`` that cannot be read, is not fourfold's, or whose weights are not the ones written."""


def weights_sha256(state: Mapping[str, torch.Tensor], config: Any, step: Any) -> str:
    """sha256 of every tensor's name, dtype, shape and bytes (in name order), then the config and step as JSON."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    h.update(json.dumps({"config": config, "step": step}, sort_keys=True, default=str).encode())
    return h.hexdigest()


def write(path: str | Path, model_state: Mapping[str, torch.Tensor], *, config: dict[str, Any], step: int) -> Path:
    """Save ``{"model", "config", "step", "format", "sha256"}`` atomically and durably; tensors moved to CPU."""
    state = {k: v.detach().cpu() for k, v in model_state.items()}
    payload = {"model": state, "config": config, "step": step, "format": FORMAT,
               "sha256": weights_sha256(state, config, step)}
    with atomic_path(path, durable=True) as tmp:
        torch.save(payload, tmp)
    return Path(path)


_FIX = "take it again from its run (copy it again, or re-run with --resume from the run's newest checkpoint)"


def read(path: str | Path) -> dict[str, Any]:
    """A ``model.pt`` written by :func:`write` (or before the digest), checked: ``weights_only=True`` (no code
    runs), fourfold's layout, and the weights, config and step the file recorded. :class:`WeightsFileError`
    otherwise, one line naming the file, what is wrong and what to do."""
    path = Path(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise WeightsFileError(f"{path} does not exist. Pass a run's model.pt (written at the end of fourfold "
                               "train unless --no-save).") from None
    except Exception as e:
        raise WeightsFileError(f"{path} is not a readable model.pt: {_unreadable(path, e)}; {_FIX}.") from None
    if not (isinstance(payload, dict) and isinstance(payload.get("model"), dict) and "config" in payload
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in payload["model"].items())):
        got = sorted(payload)[:6] if isinstance(payload, dict) else type(payload).__name__
        raise WeightsFileError(f"{path} is a torch file but not fourfold's model.pt ({{model, config, step}}), got "
                               f"{got}. Pass a run's model.pt; a plain state dict goes to --init-from.")
    return check(path, payload)


def check(path: str | Path, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload``, read from ``path``, if its weights, config and step are the ones the file recorded (a file
    written before the digest passes unchecked); :class:`WeightsFileError` naming the file otherwise."""
    recorded = payload.get("sha256")
    if recorded is None and payload.get("format") is None:
        return payload  # written before the digest
    _compare(path, weights_sha256(payload["model"], payload["config"], payload.get("step")), recorded)
    return payload


SAFETENSORS_KEY = "fourfold_sha256"
"""The key of :func:`weights_sha256` (config and step None) in the metadata of a ``.safetensors`` file fourfold
wrote (``fourfold export``); other readers ignore it."""


def check_tensors(path: str | Path, state: Mapping[str, torch.Tensor], recorded: str) -> None:
    """Refuse ``state``, read from ``path``, unless it hashes to ``recorded`` (:data:`SAFETENSORS_KEY`)."""
    _compare(path, weights_sha256(state, None, None), recorded)


def _compare(path: str | Path, got: str, recorded: Any) -> None:
    if got != recorded:
        raise WeightsFileError(f"{path} is damaged: its weights and settings hash to sha256 {got[:16]}..., the file "
                               f"recorded {str(recorded)[:16]}... when it was written; {_FIX}.")


def _unreadable(path: Path, error: Exception) -> str:
    size = path.stat().st_size if path.is_file() else None
    if size == 0:
        return "it is empty (0 bytes: the copy or the save was cut before any byte)"
    with open(path, "rb") as f:
        head = f.read(512)
    if not head.startswith(b"PK"):
        try:
            head.decode("utf-8")
            return f"it holds text, not a torch file ({size:,} bytes, starting {head[:40].decode('utf-8')!r})"
        except UnicodeDecodeError:
            return f"it is not a torch file ({size:,} bytes that do not start as torch.save's zip does)"
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
    return f"it is truncated or damaged ({size:,} bytes; torch.load: {type(error).__name__}: {first})"
