"""Node names as operators type them: lists and ranges (``node[1-4],gpu-a``, as Slurm's
hostlists), and a did-you-mean for a name the fleet does not know. Pure."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable

from schemas.errors import InvalidToken
from schemas.subjects import check_token

RANGE = re.compile(r"^(?P<head>[^\[\]]*)\[(?P<first>\d+)-(?P<last>\d+)\](?P<tail>[^\[\]]*)$")
MAX_NODES = 10_000
"""Nodes one list may name (a bound on what a typo like node[1-99999999] expands to)."""


def expand_nodes(text: str) -> list[str]:
    """``node[1-4],gpu-a`` as [node1, node2, node3, node4, gpu-a] (a range keeps the
    zero padding of its first number: ``n[08-10]`` is n08 n09 n10); each name checked as
    a node id; InvalidToken names what is wrong."""
    names: list[str] = []
    for part in re.split(r",(?![^\[]*\])", text):
        found = RANGE.match(part)
        if found is None:
            names.append(check_token("node id", part))
            continue
        first, last = found["first"], found["last"]
        if int(last) < int(first) or int(last) - int(first) >= MAX_NODES:
            raise InvalidToken("node range", part)
        width = len(first) if first.startswith("0") else 0
        for number in range(int(first), int(last) + 1):
            names.append(
                check_token("node id", f"{found['head']}{number:0{width}d}{found['tail']}")
            )
        if len(names) > MAX_NODES:
            raise InvalidToken("node list", f"{text[:60]} (more than {MAX_NODES} nodes)")
    return list(dict.fromkeys(names))


def node_selection(text: str) -> str:
    """An argparse type: a node id, or a list or range of them (:func:`expand_nodes`)."""
    try:
        expand_nodes(text)
    except InvalidToken as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean node-1?)`` for the closest known names, or ""."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""
