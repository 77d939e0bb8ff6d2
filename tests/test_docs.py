"""The docs' Python: every ``from fourfold... import ...`` in a README or docs/*.md code block names something that
exists (the snippets were copied into scripts by users, and a moved function broke them at their first line).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _fourfold_imports() -> list[tuple[str, str, list[str]]]:
    """(file, module, names) of each ``from fourfold... import`` in the docs' Python blocks."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in BLOCK.findall(path.read_text()):
            lines = block.splitlines()
            for i, line in enumerate(lines):
                if not line.startswith("from fourfold"):
                    continue
                text = line.split("#")[0]
                while text.count("(") > text.count(")"):  # a parenthesised list goes on
                    i += 1
                    text += " " + lines[i].split("#")[0]
                node = ast.parse(text.strip()).body[0]
                assert isinstance(node, ast.ImportFrom) and node.module
                found.append((path.name, node.module, [a.name for a in node.names]))
    return found


def test_every_fourfold_import_in_the_docs_exists():
    imports = _fourfold_imports()
    assert len(imports) >= 10, imports  # the scan finds the docs' imports
    missing = [f"{file}: from {module} import {name}" for file, module, names in imports for name in names
               if not hasattr(importlib.import_module(module), name)]
    assert not missing, missing
