"""Python files parsed for the static tests (what the suite reads of its own tree)."""

from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse_file(path: Path) -> ast.Module:
    """``path`` parsed with the garbage collector held off. CPython 3.11's AST constructor
    loses count of its recursion when a finaliser runs inside it (an unclosed transport
    an earlier test of the same worker left to the collector) and raises ``SystemError:
    AST constructor recursion depth mismatch``, as the suite once did. No collection is
    forced first: the finalisers that matter run only from an automatic collection, which
    is held off, and a forced one per file cost a worker full of earlier tests' objects
    over a minute (the static tests parse hundreds of files)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(), filename=str(path))
    finally:
        if enabled:
            gc.enable()
