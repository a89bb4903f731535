"""The commit-msg hook (.pre-commit-config.yaml): a commit's subject line is under 72
characters and the detail goes in the body, after a blank line. ``python -m
tests.commit_msg FILE`` checks the message git wrote to FILE and says what is wrong."""

from __future__ import annotations

import sys
from pathlib import Path

SUBJECT_LIMIT = 72
"""A subject this long or longer is refused (git's one-line views cut it)."""
SCISSORS = "# ------------------------ >8 ------------------------"
"""``git commit --verbose`` shows the diff below this line; it is not the message."""


def problems(message: str) -> list[str]:
    """What is wrong with ``message`` as git will record it (comment lines, and what
    follows the scissors line, left out): nothing, or a line for each rule broken."""
    kept: list[str] = []
    for line in message.splitlines():
        if line == SCISSORS:
            break
        if not line.startswith("#"):
            kept.append(line.rstrip())
    while kept and not kept[0]:
        kept.pop(0)
    if not kept:
        return ["the message is empty"]
    found = []
    subject = kept[0]
    if len(subject) >= SUBJECT_LIMIT:
        found.append(
            f"the subject line is {len(subject)} characters: keep it under "
            f"{SUBJECT_LIMIT} and put the detail in the body"
        )
    if len(kept) > 1 and kept[1]:
        found.append("a blank line goes between the subject line and the body")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m tests.commit_msg COMMIT_MESSAGE_FILE\n")
        return 2
    found = problems(Path(argv[0]).read_text(encoding="utf-8"))
    for problem in found:
        sys.stderr.write(f"commit message: {problem}\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
