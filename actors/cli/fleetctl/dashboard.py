"""The dashboard's logins from the command line: ``fleetctl ui-user NAME`` prints a line
for the aggregator's ``http_users_file``, with the password hashed
(:mod:`actors.runtime.http_login`; read from the terminal without echo, or from the first
line of standard input); ``fleetctl dashboard`` prints a one-time login link signed with
the dashboard's key (:mod:`actors.runtime.login_links`)."""

from __future__ import annotations

import argparse
import getpass
import sys
import time
from pathlib import Path

from actors.cli.common import KEY_FILE_ENV, default_operator_key, token
from actors.cli.parsing import fail
from actors.runtime.http_login import hash_password
from actors.runtime.login_links import LIFETIME, login_link
from schemas import signing

MIN_PASSWORD = 12
DEFAULT_URL = "http://127.0.0.1:9092"
"""The aggregator's HTTP port where nothing moved it."""


async def cmd_ui_user(args: argparse.Namespace) -> int:
    if sys.stdin.isatty():
        password = getpass.getpass(f"password for {args.name}: ")
        if getpass.getpass("again: ") != password:
            return fail("the passwords differ")
    else:
        password = sys.stdin.readline().rstrip("\n")
    if len(password) < MIN_PASSWORD:
        return fail(f"a password of at least {MIN_PASSWORD} characters, please")
    sys.stdout.write(f"{args.name}:{hash_password(password)}\n")
    return 0


async def cmd_dashboard(args: argparse.Namespace) -> int:
    if not args.url.startswith(("http://", "https://")):
        return fail(f"--url {args.url!r}: give the dashboard's http:// or https:// URL")
    key = signing.load_key_file(args.key_file or default_operator_key())
    sys.stdout.write(f"{login_link(args.url, key, time.time())}\n")
    return 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "ui-user",
        help="print a user line for the aggregator's http_users_file (dashboard login)",
        description="Reads the password (without echo on a terminal, else the first line of "
        "standard input) and prints NAME:<PBKDF2-SHA256 hash>; append it to the file named "
        "by the aggregator's http_users_file, which is read again when it changes.",
    )
    parser.add_argument("name", type=token("user name"), help="the user's login name")
    parser.set_defaults(func=cmd_ui_user)

    link = commands.add_parser(
        "dashboard",
        help="print a one-time login link to a dashboard that sends commands",
        description="Prints <URL>/ui/login?t=TOKEN, signed with the key the aggregator signs "
        f"the dashboard's commands with (its ui_key_file). It works once, within "
        f"{LIFETIME:.0f} s, and gives the browser that opens it a session (ui_session_*).",
    )
    link.add_argument(
        "--url",
        default=DEFAULT_URL,
        help=f"the dashboard's base URL, as the browser reaches it (default {DEFAULT_URL})",
    )
    link.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help=f"the dashboard's key, its ui_key_file (env {KEY_FILE_ENV}; default "
        f"{default_operator_key()})",
    )
    link.set_defaults(func=cmd_dashboard)
