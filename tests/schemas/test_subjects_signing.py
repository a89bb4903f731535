"""Subjects refuse unsafe tokens; signatures bind a key to the exact body bytes."""

from __future__ import annotations

import base64
from pathlib import Path

import nacl.exceptions
import nacl.signing
import nkeys
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import signing
from schemas.errors import InvalidToken, KeyFileError, SignatureError
from schemas.subjects import Subjects, check_token


@pytest.mark.parametrize("token", ["", "a.b", "a b", "*", ">", "x" * 65, "nöde", "a\nb"])
def test_unsafe_tokens_are_refused(token: str) -> None:
    """Dots, wildcards, spaces, non-ASCII and over-long ids never reach a subject."""
    with pytest.raises(InvalidToken, match="invalid node id"):
        Subjects().heartbeat("c1", token)


def test_subjects_follow_the_contract() -> None:
    """Each builder produces the subject the wire contract names."""
    s = Subjects()
    assert s.heartbeat("c1", "n1") == "fleet.hb.c1.n1"
    assert s.event("n1", "sample") == "fleet.evt.n1.sample"
    assert s.command("c1", "n1") == "fleet.cmd.c1.n1"
    assert s.result("c1", "n1") == "fleet.result.c1.n1"
    assert s.alert("stale", "c1", "n1") == "fleet.alert.stale.c1.n1"
    assert s.register() == "fleet.register"
    assert s.probe("n1") == "fleet.probe.n1"
    assert s.split_heartbeat("fleet.hb.c1.n1") == ("c1", "n1")
    with pytest.raises(InvalidToken):
        s.split_heartbeat("fleet.cmd.c1.n1")


@given(st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True))
def test_every_safe_token_is_accepted(token: str) -> None:
    """The accepted alphabet is exactly [A-Za-z0-9_-]{1,64}."""
    assert check_token("node id", token) == token


def test_keys_are_nats_nkeys() -> None:
    """Our seeds and public keys are the ones the nkeys library derives (NATS auth works)."""
    pair = signing.KeyPair.generate()
    assert pair.seed.startswith("SU") and pair.public_key.startswith("U")
    assert nkeys.from_seed(pair.seed.encode()).public_key.decode() == pair.public_key


def test_signature_verifies_over_exact_bytes() -> None:
    """A signed body verifies and names its signer; one changed byte fails."""
    pair = signing.KeyPair.generate()
    body = b'{"node_id":"n1","seq":1}'
    headers = pair.headers(body)
    assert signing.verify(headers, body) == pair.public_key
    with pytest.raises(SignatureError, match="does not match"):
        signing.verify(headers, body.replace(b"1}", b"2}"))


def test_wrong_key_or_missing_headers_fail() -> None:
    """Another key's name on the signature, garbage, or no headers are all refused."""
    pair, other = signing.KeyPair.generate(), signing.KeyPair.generate()
    body = b"x"
    forged = {**pair.headers(body), signing.HEADER_KEY: other.public_key}
    with pytest.raises(SignatureError, match="does not match"):
        signing.verify(forged, body)
    with pytest.raises(SignatureError, match="missing"):
        signing.verify(None, body)
    with pytest.raises(SignatureError, match="bad Fleet-Key"):
        signing.verify({**pair.headers(body), signing.HEADER_KEY: "UNOTAKEY"}, body)
    short = base64.b64encode(b"short").decode()
    with pytest.raises(SignatureError, match="64 bytes"):
        signing.verify({**pair.headers(body), signing.HEADER_SIG: short}, body)


def test_key_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    """init writes mode 0600 and refuses to replace an existing identity."""
    path = tmp_path / "node.nk"
    pair = signing.create_key_file(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert signing.load_key_file(path).public_key == pair.public_key
    with pytest.raises(KeyFileError, match="already exists"):
        signing.create_key_file(path)
    path.write_text("not a seed")
    with pytest.raises(KeyFileError, match="not an nkey seed"):
        signing.load_key_file(path)


def _bitwise_crc16(data: bytes) -> int:
    """CRC-16/XMODEM bit by bit, as the nkeys specification gives it."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        crc &= 0xFFFF
    return crc


@given(st.binary(max_size=64))
def test_nkey_checksum_is_crc16_xmodem(data: bytes) -> None:
    """The C checksum nkeys are checked with equals the specification's bitwise one."""
    assert signing._crc16(data) == _bitwise_crc16(data)


@given(
    st.one_of(
        st.binary(max_size=40).map(lambda raw: base64.b32encode(raw).decode().rstrip("=")),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ234567=01aé ", max_size=64),
    )
)
def test_base32_decode_answers_as_the_standard_library(text: str) -> None:
    """Keys and seeds of every length, and text with letters outside the alphabet
    (padding, digits 0 and 1, lowercase, non-ASCII): the same bytes, or the same refusal,
    as base64.b32decode of the padded text."""
    padded = text + "=" * (-len(text) % 8)
    try:
        expected: bytes | type[Exception] = base64.b32decode(padded)
    except ValueError as exc:  # binascii.Error, and non-ASCII text
        expected = type(exc)
    try:
        found: bytes | type[Exception] = signing._b32decode(text)
    except ValueError as exc:
        found = type(exc)
    assert found == expected


def test_a_public_key_decodes_through_the_fast_path() -> None:
    """A 56-letter public key is decoded as one number, to the key that checks the pair's
    signatures."""
    pair = signing.KeyPair.generate()
    assert len(pair.public_key) == 56 and signing._BASE32_TEXT.fullmatch(pair.public_key)
    verifier = nacl.signing.VerifyKey(signing.public_key_bytes(pair.public_key))
    assert verifier.verify(b"body", pair.sign(b"body")) == b"body"


ED25519_ORDER = 2**252 + 27742317777372353535851937790883648493
"""L, the order of Ed25519's base point: a signature whose S is not below it is not
canonical, and libsodium refuses it."""

CRAFTED_SIGNATURES = [
    bytes(64),  # R and S zero: R is a point of small order
    bytes([1]) + bytes(63),  # R the neutral element, S zero
    bytes(32) + ED25519_ORDER.to_bytes(32, "little"),  # S == L
    bytes(32) + (2**256 - 1).to_bytes(32, "little"),  # S far above L
]


def _pynacl_accepts(key: bytes, signature: bytes, body: bytes) -> bool:
    try:
        nacl.signing.VerifyKey(key).verify(body, signature)
    except nacl.exceptions.BadSignatureError:
        return False
    return True


def _we_accept(key: bytes, public_key: str, signature: bytes, body: bytes) -> bool:
    headers = {
        signing.HEADER_KEY: public_key,
        signing.HEADER_SIG: base64.b64encode(signature).decode(),
    }
    try:
        signing.verify_with(key, public_key, headers, body)
    except SignatureError:
        return False
    return True


@given(
    body=st.binary(max_size=5000),
    flip=st.integers(min_value=-1, max_value=511),
    forged=st.one_of(
        st.none(), st.binary(min_size=64, max_size=64), st.sampled_from(CRAFTED_SIGNATURES)
    ),
    other_body=st.booleans(),
)
def test_the_detached_check_agrees_with_pynacl(
    body: bytes, flip: int, forged: bytes | None, other_body: bool
) -> None:
    """``verify_with`` calls libsodium's detached check, not PyNaCl's ``VerifyKey``: for
    a good signature, one with a bit flipped, one of random or crafted bytes (small-order
    R, S not below the group order), and a body changed after signing, both accept
    exactly the same."""
    pair = signing.KeyPair.generate()
    key = signing.public_key_bytes(pair.public_key)
    signature = forged if forged is not None else pair.sign(body)
    if flip >= 0:
        flipped = bytearray(signature)
        flipped[flip // 8] ^= 1 << (flip % 8)
        signature = bytes(flipped)
    checked = body + b"x" if other_body else body
    assert _we_accept(key, pair.public_key, signature, checked) == _pynacl_accepts(
        key, signature, checked
    )
    if forged is None and flip < 0 and not other_body:
        assert _we_accept(key, pair.public_key, signature, checked)


def test_a_key_of_the_wrong_length_never_reaches_libsodium() -> None:
    """The C check reads 32 key bytes: a shorter key is refused before it."""
    pair = signing.KeyPair.generate()
    headers = pair.headers(b"body")
    with pytest.raises(SignatureError, match="32-byte"):
        signing.verify_with(b"short", pair.public_key, headers, b"body")
