"""What both command-line tools share: error handling, signals, the operator's paths."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import msgspec

from actors.cli.parsing import fail
from actors.runtime import config_docs
from actors.runtime.config import (
    DEFAULT_SERVER,
    Layers,
    layers,
    list_fields,
)
from actors.runtime.schedule import stop_if_cancelled
from schemas.errors import FleetError, InvalidToken
from schemas.subjects import check_token

if TYPE_CHECKING:
    from actors.runtime.bus import NatsBus
    from schemas.signing import KeyPair

CLIENT_ENV_PREFIX = "FLEETCTL_"


class ClientConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a fleetctl command reaches NATS: each a flag, a ``FLEETCTL_*`` variable (or
    ``NATS_URL``) and a key of ``--config``, through the same loader as the daemons."""

    server: str = DEFAULT_SERVER
    """NATS URL(s) of the fleet, comma-separated (``NATS_URL`` also sets it): ``nats://`` or
    ``tls://`` (TLS required)."""
    nkey_file: str = ""
    """Authenticate to NATS with this nkey seed (servers configured like auth.conf)."""
    tls_ca: str = ""
    """PEM file of the CA that signed the server's certificate; empty: the system's CAs."""
    tls_cert: str = ""
    """PEM client certificate (mutual TLS); needs tls_key."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    key_file: str = ""
    """The operator key that signs commands (``fleetctl up`` prints the line that exports
    it); see :func:`operator_key_file`. A setting of every command, so that
    ``FLEETCTL_KEY_FILE`` is known to all, not only to those that sign; those take
    ``--key-file`` themselves."""
    trust_operators: list[str] = []
    """Operator public keys the fleet trusts, as the agents' and aggregators'
    trust_operators list them: a signing key among them is signed with though it is also
    a node's own key (no warning, no --sign-with-node-key)."""
    trust_operators_file: str = ""
    """A file of such keys, one a line (# comments), read as the agents read theirs
    (their trust_operators_file, say /etc/node-agent/operators, copied here)."""


SIGNING_ONLY = frozenset({"key_file", "trust_operators", "trust_operators_file"})
"""ClientConfig settings that get no flag from :func:`add_server`: a command that signs
declares its own ``--key-file`` (and the trust list flags of
:func:`actors.cli.fleetctl.signer.add_signing_check`)."""


def add_server(parser: argparse.ArgumentParser) -> None:
    """--context, --prefix and :class:`ClientConfig`'s flags, for every fleetctl command
    that connects (:mod:`actors.cli.fleetctl.contexts` fills in what the context gives)."""
    add_context_flag(parser)
    parser.add_argument(
        "--prefix", help="subject prefix of the fleet (default: the context's, else fleet)"
    )
    add_config_flags(parser, ClientConfig, CLIENT_ENV_PREFIX, skip=SIGNING_ONLY)


def add_context_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--context",
        help=f"the context of {contexts_path()} to use (default: its current-context)",
    )


Settings = TypeVar("Settings", bound=msgspec.Struct)


SINGULAR_FLAGS = {
    "engines": "engine",
    "peers": "peer",
    "trust_operators": "trust-operator",
    "http_public_names": "http-public-name",
    "workloads_operators": "workloads-operator",
    "required_binaries": "require-binary",
    "required_modules": "require-module",
    "xid_thresholds": "xid-threshold",
    "gpu_thresholds": "gpu-threshold",
    "workload_engines": "workload-engine",
    "workload_binaries": "workload-binary",
    "workload_args": "workload-arg",
    "workload_env": "workload-env",
    "workload_images": "workload-image",
    "labels": "label",
    "version_programs": "version-program",
    "alertmanager_urls": "alertmanager-url",
}
"""The name of each list setting's flag in the singular (``--engine vllm=URL --engine
sglang=URL``), the same in both CLIs; the plural (the setting's own name, as
``--trust-operators``) stays accepted, hidden from ``--help``. A list setting not named
here gets its flag under its own name: every list setting is repeatable and takes
comma-separated items either way (:func:`actors.runtime.config.list_fields`)."""


def flag_name(name: str) -> str:
    """The flag ``--help`` shows for setting ``name``: ``--trust-operator``, ``--server``."""
    return f"--{SINGULAR_FLAGS.get(name, name).replace('_', '-')}"


class Setting(NamedTuple):
    """Which setting a flag sets: its help line is read from here when asked for."""

    config_type: type[msgspec.Struct]
    name: str
    env_prefix: str


class _SettingHelp(argparse.Action):
    """A setting's flag whose help line (:func:`config_docs.flag_help`: docstring,
    default, variable) is built when something reads it (``--help``, completion, the
    docs), not with the parser: building the help of node-agent's 207 flags took longer
    than the rest of a command's start, and most runs never show it."""

    def __init__(self, *args: Any, setting: Setting, **kwargs: Any) -> None:
        self.setting = setting
        super().__init__(*args, **kwargs)

    @property
    def help(self) -> str:
        config_type, name, env_prefix = self.setting
        return config_docs.flag_help(config_type, name, env_prefix).replace("%", "%%")

    @help.setter
    def help(self, given: str | None) -> None:
        """argparse sets ``help=None`` as it builds the action; the setting's text stands."""


class _SettingStore(_SettingHelp, argparse._StoreAction):
    pass


class _SettingAppend(_SettingHelp, argparse._AppendAction):
    pass


class _SettingSwitch(_SettingHelp, argparse.BooleanOptionalAction):
    pass


def add_config_flags(
    parser: argparse.ArgumentParser,
    config_type: type[msgspec.Struct],
    env_prefix: str,
    skip: frozenset[str] = frozenset(),
) -> None:
    """``--config FILE`` and one flag per field of ``config_type`` but those in ``skip``,
    so flags, env and TOML can never drift apart; each flag's help is the setting's own
    docstring and default (:mod:`actors.runtime.config_docs`), built when read."""
    parser.add_argument(
        "--config", type=Path, help="TOML file of settings (flags and env variables beat it)"
    )
    lists = list_fields(config_type)
    for field in msgspec.structs.fields(config_type):
        if field.name in skip:
            continue
        setting = Setting(config_type, field.name, env_prefix)
        flag = f"--{field.name.replace('_', '-')}"
        if field.name in lists:
            # Each use appends its text; build() splits the items on commas.
            shown = flag_name(field.name)
            metavar = shown.removeprefix("--").replace("-", "_").upper()
            parser.add_argument(
                shown, dest=field.name, action=_SettingAppend, metavar=metavar, setting=setting
            )
            if flag != shown:
                parser.add_argument(flag, dest=field.name, action="append", help=argparse.SUPPRESS)
        elif field.type is bool:
            parser.add_argument(
                flag, dest=field.name, action=_SettingSwitch, default=None, setting=setting
            )
        else:
            parser.add_argument(flag, dest=field.name, action=_SettingStore, setting=setting)


def settings_from(
    args: argparse.Namespace, config_type: type[Settings], env_prefix: str
) -> Settings:
    """The settings: the flags given, over ``<env_prefix>*`` variables, over ``--config``,
    over fleetctl's context (``args.context_settings``, set by
    :mod:`actors.cli.fleetctl.contexts`)."""
    return layers_from(args, config_type, env_prefix).build()


def layers_from(
    args: argparse.Namespace, config_type: type[Settings], env_prefix: str
) -> Layers[Settings]:
    """The layers :func:`settings_from` merges, kept (the agent merges the fleet's
    settings in between)."""
    names = {field.name for field in msgspec.structs.fields(config_type)}
    flags = {name: getattr(args, name) for name in names if hasattr(args, name)}
    # A flag typed Path (--key-file) is a str setting.
    flags = {name: str(v) if isinstance(v, Path) else v for name, v in flags.items()}
    base = getattr(args, "context_settings", None)
    return layers(config_type, env_prefix, file=args.config, flags=flags, base=base)


@asynccontextmanager
async def connected(args: argparse.Namespace, name: str) -> AsyncIterator[NatsBus]:
    """A connection as the command line asks (:class:`ClientConfig`), drained on the way out."""
    async with connected_to(settings_from(args, ClientConfig, CLIENT_ENV_PREFIX), name) as bus:
        yield bus


@asynccontextmanager
async def connected_to(config: ClientConfig, name: str) -> AsyncIterator[NatsBus]:
    """A connection by resolved settings (a ``fleetctl simulate`` worker gets its parent's).
    NATS, TLS and the keys are imported here, by the commands that connect: the others
    (``--version``, ``--help``, ``keys``, ``config``) start without them."""
    from actors.runtime.bus import NatsBus
    from actors.runtime.tls import client_context
    from schemas import signing

    seed = signing.load_key_file(Path(config.nkey_file)).seed if config.nkey_file else None
    tls = client_context(config.tls_ca, config.tls_cert, config.tls_key)
    bus = await NatsBus.connect(config.server, name, nkey_seed=seed, connect_timeout=3.0, tls=tls)
    try:
        yield bus
    finally:
        await bus.close()


KEY_FILE_ENV = "FLEETCTL_KEY_FILE"


def default_operator_key() -> Path:
    """``$FLEETCTL_KEY_FILE`` if set (``fleetctl up`` prints the line that sets it), so an
    operator need not repeat ``--key-file`` on every command; else the per-user default."""
    return Path(os.environ.get(KEY_FILE_ENV) or config_home() / "fleetctl" / "operator.nk")


def operator_key_file(args: argparse.Namespace) -> Path:
    """The operator key a signing command uses: ``--key-file``, else ``FLEETCTL_KEY_FILE``
    or the ``--config`` file's ``key_file``, else the per-user default."""
    configured = settings_from(args, ClientConfig, CLIENT_ENV_PREFIX).key_file
    return Path(configured) if configured else default_operator_key()


def operator_key(args: argparse.Namespace) -> KeyPair:
    """The operator key pair of :func:`operator_key_file`; a missing one is an error that
    says how to make one (or where ``fleetctl up`` keeps its own)."""
    from schemas import signing

    path = operator_key_file(args)
    if not path.exists():
        raise FleetError(
            f"operator key {path} not found: create one with 'fleetctl keys init', or "
            "export FLEETCTL_KEY_FILE (the line 'fleetctl up' prints), or pass --key-file"
        )
    return signing.load_key_file(path)


def config_home() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base)


def contexts_path() -> Path:
    """fleetctl's contexts file (:mod:`actors.cli.fleetctl.contexts`)."""
    return config_home() / "fleetctl" / "config.toml"


def token(what: str) -> Callable[[str], str]:
    """An argparse type for a subject token (node id, cluster): a bad one is a usage
    error before anything connects."""

    def check(value: str) -> str:
        try:
            return check_token(what, value)
        except InvalidToken as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return check


def run_main(entry: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run an async command; known errors become one line on stderr and exit 1, a
    Ctrl-C exit 130 (also one whose cancel a library lost on the way:
    :func:`stop_if_cancelled`)."""

    async def command() -> int:
        code = await entry()
        stop_if_cancelled()
        return code

    try:
        return asyncio.run(command())
    except FleetError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        import nats.errors  # here, not above: a command that never connects starts without

        if not isinstance(exc, nats.errors.Error):
            raise
        return fail(f"NATS: {exc}")


def stop_event(
    last_words: Callable[[], None] | None = None,
    signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
) -> asyncio.Event:
    """An event set by one of ``signals``; the second one calls ``last_words`` (what must
    not outlive the process: a child in a process group of its own) and exits at once."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            if last_words is not None:
                last_words()
            os._exit(130)
        stop.set()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    return stop
