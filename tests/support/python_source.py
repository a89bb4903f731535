"""Python files parsed for the static tests (what the suite reads of its own tree)."""

from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse_file(path: Path) -> ast.Module:
    """``path`` parsed with the garbage collector held off. CPython 3.11's AST constructor
    loses count of its recursion when a finaliser runs inside it (an unclosed transport
    an earlier test of the same worker left to the collector) and raises ``SystemError:
    AST constructor recursion depth mismatch``, as the suite once did."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        return ast.parse(path.read_text(), filename=str(path))
    finally:
        if enabled:
            gc.enable()
