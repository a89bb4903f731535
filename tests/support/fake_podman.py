"""A stand-in for ``podman`` where containers cannot run (no podman, or a sandbox that
refuses them): the subcommands the container workloads use, answered as podman 4 does.

``image exists -- IMAGE`` exits 0 once the image was pulled (a marker file), 1 before;
``pull -- IMAGE`` writes podman's progress lines to stderr and the marker; ``rm`` records
its arguments; ``run [OPTIONS] -- IMAGE COMMAND...`` writes a container id to
``--cidfile``, records its argv, and execs the llama.cpp stand-in with COMMAND's
arguments (``--host 0.0.0.0`` made 127.0.0.1, where the published port would be), so it
is the foreground process podman's ``run`` is. Its state lives in ``FAKE_PODMAN_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

VALUED = {
    "--name", "--cidfile", "--pull", "--publish", "--cap-drop", "--security-opt", "--label",
    "--env", "--device",
}  # fmt: skip
CONTAINER_ID = "c0ffee" * 10 + "beef"


def marker(state: Path, image: str) -> Path:
    return state / ("pulled-" + image.replace("/", "_").replace(":", "_"))


def main(argv: list[str]) -> int:
    state = Path(os.environ["FAKE_PODMAN_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    if argv[:3] == ["image", "exists", "--"]:
        return 0 if marker(state, argv[3]).exists() else 1
    if argv[:2] == ["pull", "--"]:
        for line in (
            f"Trying to pull {argv[2]}...",
            "Getting image source signatures",
            "Copying blob sha256:5d20c808ce19 done",
            "Writing manifest to image destination",
        ):
            sys.stderr.write(line + "\n")
        marker(state, argv[2]).touch()
        return 0
    if argv[:1] == ["rm"]:
        with (state / "removed").open("a") as log:
            log.write(" ".join(argv) + "\n")
        return 0
    if argv[:1] == ["run"]:
        recorded = state / "run.json.new"  # replaced whole: a reader never sees half
        recorded.write_text(json.dumps(argv))
        recorded.replace(state / "run.json")
        options: dict[str, list[str]] = {}
        i = 1
        while argv[i] != "--":  # as podman's parser: options until "--", then the image
            if argv[i] in VALUED:
                options.setdefault(argv[i], []).append(argv[i + 1])
                i += 2
            elif argv[i].startswith("--"):
                i += 1
            else:
                sys.stderr.write(f"fake podman: {argv[i]!r} before '--' is not an option\n")
                return 125
        image, command = argv[i + 1], argv[i + 2 :]
        if not marker(state, image).exists():
            sys.stderr.write(f"Error: {image}: image not known\n")
            return 125
        Path(options["--cidfile"][0]).write_text(CONTAINER_ID)
        args = ["127.0.0.1" if arg == "0.0.0.0" else arg for arg in command[1:]]
        python = sys.executable
        os.execv(python, [python, "-m", "tests.support.llamacpp_standin", *args])
    sys.stderr.write(f"fake podman: {argv} not supported\n")
    return 125


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
