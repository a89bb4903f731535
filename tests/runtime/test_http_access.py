"""The HTTP port's access parts on their own: Host names, one-time links, sessions and
their form tokens, the failed-login throttle, and a login check whose cost does not
depend on whether the user exists."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from actors.runtime.http_access import Hosts, host_name
from actors.runtime.http_login import Users, credentials, hash_password
from actors.runtime.http_sessions import MAX_SESSIONS, SESSIONS_PER_USER, Sessions
from actors.runtime.http_throttle import WINDOW, LoginThrottle, address_key
from actors.runtime.login_links import LIFETIME, LOGIN_PATH, LinkTokens, login_link, make_token
from schemas import signing


class Clock:
    """A clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_host_values_are_read_as_browsers_send_them() -> None:
    """Ports, brackets, case and a trailing dot are dropped; what is not a host is empty."""
    cases = {
        "127.0.0.1:9092": "127.0.0.1",
        "LocalHost": "localhost",
        "fleet.example.com.:443": "fleet.example.com",
        "[::1]:9092": "::1",
        "[::1]": "::1",
        "::1": "",
        "[::1": "",
        "[::1]x": "",
        "host:port": "",
        "host:\uff11\uff12": "",  # fullwidth digits: not a port
    }
    assert {value: host_name(value) for value in cases} == cases


def test_only_the_servers_own_names_pass() -> None:
    """The bound address, the address a connection arrived on, localhost and the public
    names pass; an attacker's name, another address, an empty Host do not; a public name
    that is not a host name is refused when configured."""
    hosts = Hosts("127.0.0.1", ["fleet.example.com", "10.0.0.5", "[fd00::5]"])
    allowed = ["127.0.0.1:9092", "localhost:9092", "LOCALHOST", "fleet.example.com.", "10.0.0.5"]
    allowed += ["[fd00::5]:9092"]
    assert all(hosts.allows(host, "127.0.0.1") for host in allowed)
    refused = ["rebind.attacker.example", "fleet.example.com.evil", "127.0.0.2", "", "[::1"]
    assert not any(hosts.allows(host, "127.0.0.1") for host in refused)
    anywhere = Hosts("0.0.0.0", [])
    assert anywhere.allows("192.0.2.7:9092", "192.0.2.7")
    assert anywhere.allows("192.0.2.7", "::ffff:192.0.2.7")
    assert not anywhere.allows("0.0.0.0:9092", "192.0.2.7")
    assert not anywhere.allows("192.0.2.8", "192.0.2.7")
    for bad in ("http://fleet.example.com", "fleet.example.com/x", "", "a b"):
        with pytest.raises(ValueError, match="not a host name or address"):
            Hosts("127.0.0.1", [bad])


def test_a_login_link_works_once_within_its_lifetime() -> None:
    """A link's token is redeemed once; an old one, one from the future, one signed by
    another key, a tampered one and garbage are refused."""
    key, other = signing.KeyPair.generate(), signing.KeyPair.generate()
    now = 1_700_000_000.0
    tokens = LinkTokens()
    token = make_token(key, now)
    assert login_link("http://127.0.0.1:9092/", key, now).startswith(
        f"http://127.0.0.1:9092{LOGIN_PATH}?t="
    )
    assert tokens.redeem(token, key.public_key, now + 1)
    assert not tokens.redeem(token, key.public_key, now + 2), "a second use"
    assert not tokens.redeem(make_token(key, now - LIFETIME - 1), key.public_key, now)
    assert not tokens.redeem(make_token(key, now + 3600), key.public_key, now)
    assert not tokens.redeem(make_token(other, now), key.public_key, now)
    issued, nonce, signature = make_token(key, now).split(".")
    assert not tokens.redeem(f"{issued}.{nonce}x.{signature}", key.public_key, now)
    assert not tokens.redeem(f"{int(issued) + 1}.{nonce}.{signature}", key.public_key, now)
    for garbage in ("", "..", "x.y.z", "²." + nonce + "." + signature, "1." * 500):
        assert not tokens.redeem(garbage, key.public_key, now)
    assert tokens.redeem(f"{issued}.{nonce}.{signature}", key.public_key, now)


def test_sessions_expire_and_are_bounded() -> None:
    """A session ends after its idle time and after its lifetime however used; a user's
    ninth login ends that user's oldest, not another's; in all at most MAX_SESSIONS,
    the least recently used going first."""
    clock = Clock()
    sessions = Sessions(lifetime=100.0, idle=10.0, clock=clock)
    cookie, session = sessions.start("alice")
    clock.now += 9
    assert sessions.get(cookie) is session
    clock.now += 11
    assert sessions.get(cookie) is None and not sessions.alive(session), "idle"
    cookie, session = sessions.start("alice")
    for _ in range(11):
        clock.now += 9.5
        found = sessions.get(cookie)
    assert found is None, "past its lifetime"
    assert sessions.get("forged") is None

    bob_cookie, _ = sessions.start("bob")
    alice = [sessions.start("alice")[0] for _ in range(SESSIONS_PER_USER + 1)]
    assert sessions.get(alice[0]) is None and sessions.get(alice[1]) is not None
    assert sessions.get(bob_cookie) is not None

    crowd = Sessions(lifetime=100.0, idle=100.0, clock=clock)
    first, _ = crowd.start("u0")
    second, _ = crowd.start("u1")
    assert crowd.get(first) is not None  # now the most recently used
    for n in range(2, MAX_SESSIONS + 1):
        crowd.start(f"u{n}")
    assert len(crowd) == MAX_SESSIONS
    assert crowd.get(second) is None and crowd.get(first) is not None


def test_a_form_token_posts_once() -> None:
    """The current token is taken once; a second post with it, or a wrong one, is refused,
    and each post replaces the token."""
    _, session = Sessions(100.0, 100.0).start("alice")
    token = session.form_token
    assert session.take_form_token(token)
    assert not session.take_form_token(token)
    current = session.form_token
    assert not session.take_form_token("guess") and session.form_token != current


def test_failed_logins_are_counted_per_address_and_name() -> None:
    """After the limit of failures in a window a key waits until the oldest is WINDOW
    old; other keys do not; an IPv6 /64 is one address, IPv4-mapped addresses are IPv4."""
    clock = Clock()
    throttle = LoginThrottle(limit=3, clock=clock)
    keys = ("address 192.0.2.1", "user alice")
    for _ in range(3):
        assert throttle.wait(keys) == 0
        throttle.tried(keys)
        clock.now += 1
    assert throttle.wait(["user alice"]) == pytest.approx(WINDOW - 3)
    assert throttle.wait(["address 192.0.2.1", "user bob"]) > 0
    assert throttle.wait(["address 192.0.2.2", "user bob"]) == 0
    clock.now += WINDOW
    assert throttle.wait(keys) == 0
    throttle.tried(["user carol"])
    throttle.tried(["user carol"])
    throttle.passed(["user carol"])
    throttle.tried(["user carol"])
    assert throttle.wait(["user carol"]) == 0, "a passed try does not count"
    throttle.tried(["user carol"])
    assert throttle.wait(["user carol"]) > 0
    assert address_key("2001:db8:1:2::7") == address_key("2001:db8:1:2:ffff::1")
    assert address_key("2001:db8:1:3::7") != address_key("2001:db8:1:2::7")
    assert address_key("::ffff:192.0.2.1") == address_key("192.0.2.1") == "address 192.0.2.1"


def test_an_unknown_user_costs_the_same_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name that is not in the users file is hashed once, with the users' own iteration
    count, as a wrong password of a real user is: timing does not say who exists."""
    path = tmp_path / "users"
    path.write_text(f"alice:{hash_password('right password', iterations=1234)}\n")
    users = Users(str(path))
    hashed: list[int] = []
    real = hashlib.pbkdf2_hmac

    def counted(name: str, password: bytes, salt: bytes, iterations: int) -> bytes:
        hashed.append(iterations)
        return real(name, password, salt, iterations)

    monkeypatch.setattr(hashlib, "pbkdf2_hmac", counted)
    assert not users.check("mallory", "right password")
    assert not users.check("alice", "wrong password")
    assert users.check("alice", "right password")
    assert hashed == [1234, 1234, 1234]
    assert credentials("Basic " + "bWFsbG9yeQ==") is None, "no colon: not a login"
    assert credentials("Bearer x") is None


def test_a_password_replaced_within_one_timestamp_tick_is_read(tmp_path: Path) -> None:
    """A users file rewritten in place with a same-length line and the same modification
    time (a rewrite within one timestamp tick; set in the future so it stays within the
    tick however slow the run) is read again: the old password stops working at once."""
    path = tmp_path / "users"
    old, new = hash_password("old-pass", iterations=1000), hash_password("new-pass", 1000)
    assert len(old) == len(new)
    path.write_text(f"alice:{old}\n")
    tick = time.time_ns() + 3600 * 10**9
    os.utime(path, ns=(tick, tick))
    users = Users(str(path))
    assert users.check("alice", "old-pass")
    inode = path.stat().st_ino
    with path.open("r+") as rewrite:  # in place: same inode, same size
        rewrite.write(f"alice:{new}\n")
    os.utime(path, ns=(tick, tick))
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (inode, tick)
    assert not users.check("alice", "old-pass")
    assert users.check("alice", "new-pass")
