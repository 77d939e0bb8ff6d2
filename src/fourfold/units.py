"""Sizes in bytes, read from flags and written for people: one parser and one printer for every command
(``--memory-limit 80GB``, ``bench allreduce --sizes 4KB,1MB``, the memory tables). No torch import: the
benchmarks parse their flags before any rank starts.

    parse_bytes("1.5GB")   # 1610612736 (KB = 1024 B, as NCCL-tests and the memory tables count)
    format_bytes(3337216)  # '3.18 MB'
"""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_bytes(text: str, *, what: str = "size", unit: bool = False) -> int:
    """``"80GB"``, ``"512MB"``, ``"1.5GB"``, ``"64KiB"`` or a plain number of bytes -> bytes (K = 1024).

    ``unit``: refuse a plain number (``--gpu-mem 80`` meant 80GB, not 80 bytes); ``what`` names the value in the
    error (a flag, say)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        units = "a unit" if unit else "an optional unit"
        raise ValueError(f"{what} must be a number with {units} B, KB, MB, GB or TB, like 80GB or 512MB, "
                         f"got {text!r}.")
    if unit and not m.group(2):
        raise ValueError(f"{what} must have a unit, got {text!r}, which would be {m.group(1)} bytes. Pass "
                         f"{m.group(1)}GB (or {m.group(1)}MB; {m.group(1)}B for bytes).")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_bytes(n: float) -> str:
    """Three significant figures in the largest unit that keeps the number >= 1: ``'3.18 MB'``, ``'874 KB'``;
    from 999.5 of a unit to the next, four (``'1010 KB'``, never ``'1.01e+03 KB'``)."""
    for unit, scale in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            x = n / scale
            return f"{x:.0f} {unit}" if x >= 999.5 else f"{x:.3g} {unit}"
    return f"{n:.0f} B"
