"""Label selectors: ``key=value`` filters of ``fleetctl nodes -l`` and ``GET /nodes?label=``.

Several selectors all have to match (AND); what matching means is
:mod:`schemas.selectors`' (a node judges its fleet settings' selectors by it too).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from schemas.base import LABEL_KEY_PATTERN, LABEL_VALUE_PATTERN, MAX_LABELS
from schemas.errors import FleetError
from schemas.selectors import Selector, matches

__all__ = ["BadSelector", "Selector", "matches", "parse_selector", "parse_selectors"]

_KEY = re.compile(LABEL_KEY_PATTERN)
_VALUE = re.compile(LABEL_VALUE_PATTERN)


class BadSelector(FleetError):
    def __init__(self, text: str, why: str) -> None:
        super().__init__(f"label selector {text[:80]!r}: {why}")


def parse_selector(text: str) -> Selector:
    """``key=value`` as a selector; anything else is a BadSelector naming it."""
    key, sep, value = text.partition("=")
    if not sep:
        raise BadSelector(text, "expected key=value")
    if not _KEY.match(key) or len(key) > 63:
        raise BadSelector(text, "not a label key")
    if not _VALUE.match(value) or len(value) > 128:
        raise BadSelector(text, "not a label value")
    return key, value


def parse_selectors(texts: Iterable[str]) -> list[Selector]:
    """Every selector of ``texts``; at most MAX_LABELS of them (more cannot all match)."""
    selectors = [parse_selector(text) for text in texts]
    if len(selectors) > MAX_LABELS:
        raise FleetError(f"at most {MAX_LABELS} label selectors")
    return selectors
