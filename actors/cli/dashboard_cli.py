"""``fleetctl ui-user NAME``: a line for the aggregator's ``http_users_file``, with the
password hashed (:mod:`actors.runtime.http_login`); the password is read from the
terminal without echo, or from the first line of standard input."""

from __future__ import annotations

import argparse
import getpass
import sys

from actors.cli.common import fail, token
from actors.runtime.http_login import hash_password

MIN_PASSWORD = 12


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
