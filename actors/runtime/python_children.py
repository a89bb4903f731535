"""Python child processes that import exactly what this process imports: the
simulator's workers and the signature checks' helpers."""

from __future__ import annotations

import os
import sys


def module_command(module: str) -> list[str]:
    """This interpreter running ``module`` as its main module; with ``-P``, so a module
    in the working directory cannot take the place of the project's (the import path is
    :func:`child_env`'s)."""
    return [sys.executable, "-P", "-m", module]


def child_env() -> dict[str, str]:
    """This process's environment with its import path as the child's PYTHONPATH: the
    child imports what this process imports, also where the interpreter alone finds none
    of it (the single-file artifact's packages, extracted under SHIV_ROOT)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
