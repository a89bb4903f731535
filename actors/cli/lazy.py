"""Modules loaded on first use rather than at import, for what a library imports eagerly
that most commands never touch: nats-py imports aiohttp (for ``ws://`` servers) as it is
imported, the largest part of a client command's start (tests/bench/bench_startup.py).
Both tools defer it before building their parsers; a command that serves HTTP or dials
``ws://`` loads it at its first use, as before.

(importlib's ``LazyLoader`` does not do: on Python 3.11 an ``import`` statement of a lazy
module reads its ``__spec__``, which loads it.)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

DEFERRED = ("aiohttp",)
"""The modules the tools defer."""


class Deferred(types.ModuleType):
    """Stands in ``sys.modules`` for a module not loaded yet: the first attribute read
    (an ``import`` of it does not read one; ``from it import x`` does) loads the module in
    its place and reads it there, as every later read does."""

    def __getattr__(self, attr: str) -> Any:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attr)


def defer(name: str) -> None:
    """``name`` deferred (:class:`Deferred`); nothing if it is imported already or not
    installed."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    stand_in = Deferred(name)
    stand_in.__spec__ = spec
    sys.modules[name] = stand_in
