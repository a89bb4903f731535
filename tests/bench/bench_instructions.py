"""The aggregator's hot path in instructions, not seconds (a script, not a test).

``bench_aggregator.py --ratio`` divides CPU seconds by CPU seconds on a shared VM, where
back-to-back runs drift by ±10 % and a verify alone measured anywhere from 61 to 106 µs
within an hour: a change worth a few per cent cannot be seen there except side by side
(``--side``). This script counts instructions with valgrind's callgrind, which gives the
same count for the same work whatever else the machine does, for the part of the work
that runs in one place: a steady heartbeat from the protocol bytes the server sends
(nats-py's parser and subscription) through the aggregator's judging (``handle_batch``:
signature, decode, rules) to its packed body (``_after_judging``), in one process,
against a real nats-server for the KV reads of the first contacts. Not counted: socket
reads, the event loop's waits, fetch requests and acks (per fetch, not per heartbeat),
and what the shared machine adds to each instruction, which is why the CPU-time ratio
is the higher of the two.

Each count is the difference of two runs that set up the same (nodes enrolled, every
heartbeat signed) and judge 0 and ``--rounds`` rounds of ``--nodes`` steady heartbeats,
so setup costs nothing; the bare verify likewise (0 and ``--verifies`` PyNaCl verifies of
the same heartbeat, ``crypto_sign_open`` as the CPU bench times it). Printed: the
instructions per heartbeat, their ratio to one bare verify's, and where they go by
library. Needs valgrind (Debian: ``apt-get install -y valgrind``); about two minutes.

Run: ``python tests/bench/bench_instructions.py`` (``--rounds 8 --nodes 125``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import nacl.bindings
import nacl.signing
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.cli.simulate.publisher import SimNode, SimOptions, template
from actors.fleet.storage.registry import approve
from actors.fleet.storage.streams import provision
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.subjects import Subjects, partition_of
from tests.support.fleet import TEST_LIMITS, new_aggregator, wait_for

WARM_ROUNDS = 2
"""Rounds judged before the counted ones, in both runs: every node's first contact (a
fresh read of its key and record, a record written) and its first steady beat."""
VERIFY_KEYS = 50
ROUND_TIMEOUT = 120.0
"""Seconds a round's heartbeats may take to come through the parser under callgrind."""
LIBRARIES = {
    "/nacl/": "libsodium (the signature check)",
    "/msgspec/": "msgspec (decode, struct copies)",
    "/zstandard/": "zstd (packing the kept body)",
    "libpython": "CPython (the interpreter, objects)",
    "/libc.so": "libc (allocation, copies)",
}
"""Where each library's instructions are counted, by a part of its shared object's path."""


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds counted (default 8)")
    parser.add_argument("--nodes", type=int, default=125, help="heartbeats a round (125)")
    parser.add_argument("--verifies", type=int, default=1000, help="bare verifies counted")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "COUNT", "URL"), help="internal")
    return parser


def frame(sid: int, subject: str, reply: str, body: bytes, headers: dict[str, str]) -> bytes:
    """The ``HMSG`` the server sends for a delivered heartbeat."""
    block = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    head = block.encode()
    line = f"HMSG {subject} {sid} {reply} {len(head)} {len(head) + len(body)}\r\n"
    return line.encode() + head + body + b"\r\n"


async def judge_rounds(url: str, counted: int, rounds: int, nodes: int) -> None:
    """Set up ``nodes`` enrolled nodes and ``WARM_ROUNDS + rounds`` rounds of signed
    heartbeats, then judge the warm rounds and ``counted`` more, each fed as protocol
    bytes through a nats-py parser and subscription into the aggregator's judging."""
    bus = await NatsBus.connect(url, "instructions")
    subjects = Subjects(f"i{time.time_ns()}")
    await provision(bus.js, subjects, limits=TEST_LIMITS)
    aggregator = new_aggregator(bus, subjects.prefix, checkpoint_interval=240.0)
    trust = asyncio.create_task(aggregator.store.follow_trust())
    options = SimOptions(nodes=nodes, rate=nodes / 2.0, duration=1.0, prefix=subjects.prefix)
    sims = [SimNode(index, subjects, options, "boot") for index in range(nodes)]
    for sim in sims:
        await approve(bus, subjects, sim.node_id, sim.key.public_key)
    await wait_for(
        lambda: all(aggregator.store.cached_key(sim.node_id) for sim in sims), timeout=60
    )
    # A parser of its own (no socket): the bus's reader keeps its own for the server.
    reader = Client()
    taken: list[Msg] = []
    round_taken = asyncio.Event()

    async def take(msg: Msg) -> None:
        taken.append(msg)
        if len(taken) == nodes:
            round_taken.set()

    subscription = Subscription(reader, 1, "_INBOX.instructions", cb=take)
    subscription._start(reader._error_cb)  # type: ignore[no-untyped-call]
    reader._subs[1] = subscription
    stream = f"{subjects.prefix.upper()}_HB"
    sequence = 0
    batches: list[bytes] = []
    for _ in range(WARM_ROUNDS + rounds):
        frames = []
        for sim in sims:
            body, headers = sim.beat(repr(time.time()).encode())
            sequence += 1
            partition = partition_of(sim.node_id, aggregator.ownership.partition_count)
            subject = f"{subjects.prefix}.hb.{partition}.{options.cluster}.{sim.node_id}"
            reply = f"$JS.ACK.{stream}.i.1.{sequence}.{sequence}.{time.time_ns()}.0"
            frames.append(frame(1, subject, reply, body, headers))
        batches.append(b"".join(frames))
    for batch in batches[: WARM_ROUNDS + counted]:
        taken.clear()
        round_taken.clear()
        for start in range(0, len(batch), 32768):  # nats-py reads 32 KB at a time
            await reader._ps.parse(batch[start : start + 32768])
        async with asyncio.timeout(ROUND_TIMEOUT):
            await round_taken.wait()
        for chain in await aggregator.handle_batch(list(taken)):
            for _, step in chain:
                await step()
    accepted = aggregator.metrics.registry.get_sample_value("fleet_heartbeats_accepted_total")
    if accepted != nodes * (WARM_ROUNDS + counted):
        raise SystemExit(f"accepted {accepted} of {nodes * (WARM_ROUNDS + counted)}")
    trust.cancel()
    await bus.close()


def bare_verifies(count: int) -> None:
    """``count`` bare PyNaCl verifies of a simulated heartbeat, as the CPU bench times
    them, under VERIFY_KEYS keys in turn: the check's instructions depend on the key and
    signature (it is variable-time), so one key would count one key's luck. The keys
    come from fixed seeds, so the count is the same run after run."""
    body = template("sim-00000", SimOptions(nodes=1, rate=1.0, duration=1.0), "boot")
    signed = []
    for index in range(VERIFY_KEYS):
        pair = nacl.signing.SigningKey(hashlib.sha256(b"bench key %d" % index).digest())
        signed.append((pair.sign(body).signature, bytes(pair.verify_key)))
    for index in range(count):
        signature, key = signed[index % VERIFY_KEYS]
        nacl.bindings.crypto_sign_open(signature + body, key)


def counted(arguments: list[str], into: Path) -> Counter[str]:
    """Instructions of this script run as a child with ``arguments`` under callgrind, by
    the path of the library (shared object) that executed them."""
    child = subprocess.run(
        [
            *("valgrind", "--tool=callgrind", f"--callgrind-out-file={into}", "-q"),
            *(sys.executable, __file__, *arguments),
        ],
        capture_output=True,
        text=True,
    )
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or ["no error output"])[-1]
        raise SystemExit(f"the callgrind run {' '.join(arguments)} failed: {last[:200]}")
    annotated = subprocess.run(
        ["callgrind_annotate", "--threshold=100", str(into)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    by_library: Counter[str] = Counter()
    for line in annotated.splitlines():
        found = re.match(r"\s*([\d,]+) \(.*?\)\s+.*\[(.+)\]\s*$", line)
        if found:
            by_library[found[2]] += int(found[1].replace(",", ""))
    return by_library


def grouped(by_library: Counter[str]) -> Counter[str]:
    groups: Counter[str] = Counter()
    for library, instructions in by_library.items():
        name = next((label for key, label in LIBRARIES.items() if key in library), "other")
        groups[name] += instructions
    return groups


def main() -> int:
    args = options().parse_args()
    if args.child:
        mode, count, url = args.child
        if mode == "judge":
            asyncio.run(judge_rounds(url, int(count), args.rounds, args.nodes))
        elif mode == "verify":
            bare_verifies(int(count))
        else:
            raise SystemExit(f"--child: no mode {mode!r} (judge or verify)")
        return 0
    small = [name for name in ("rounds", "nodes", "verifies") if getattr(args, name) < 1]
    if small:
        print(f"--{small[0]} must be 1 or more")
        return 2
    missing = [tool for tool in ("valgrind", "callgrind_annotate") if not shutil.which(tool)]
    if missing:
        print(f"needs {' and '.join(missing)} (Debian: apt-get install -y valgrind)")
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        server = NatsServer(Path(scratch) / "nats").start()
        try:
            sizes = ["--rounds", str(args.rounds), "--nodes", str(args.nodes)]
            runs = {
                (mode, count): grouped(
                    counted([*sizes, "--child", mode, str(count), server.url], Path(scratch) / name)
                )
                for mode, count, name in (
                    ("judge", 0, "judge.0"),
                    ("judge", args.rounds, "judge.n"),
                    ("verify", 0, "verify.0"),
                    ("verify", args.verifies, "verify.n"),
                )
            }
        finally:
            server.stop()
    heartbeats = args.rounds * args.nodes
    # subtract, not "-": a library that ran less in the longer run still counts.
    per_heartbeat = runs["judge", args.rounds].copy()
    per_heartbeat.subtract(runs["judge", 0])
    per_verify = runs["verify", args.verifies].copy()
    per_verify.subtract(runs["verify", 0])
    total = sum(per_heartbeat.values()) / heartbeats
    verify = sum(per_verify.values()) / args.verifies
    print(
        f"{heartbeats} steady heartbeats x 8 fake GPUs, protocol bytes to packed body, "
        f"in one process (callgrind)"
    )
    print(f"| instructions per heartbeat | {total:,.0f} |")
    print(f"| instructions per bare PyNaCl verify of it | {verify:,.0f} |")
    print(f"| ratio | {total / verify:.2f} |")
    for name, instructions in sorted(per_heartbeat.items(), key=lambda item: -item[1]):
        each = instructions / heartbeats
        print(f"| {name} | {each:,.0f} ({each / verify:.2f} verifies) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
