"""Ed25519 identities as NATS nkeys, and the ``Fleet-Key`` / ``Fleet-Sig`` signature headers.

A signature covers the exact body bytes. Verifiers check the bytes they received and only
then decode: nothing is ever re-encoded to be verified, so any JSON library can sign.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import importlib.util
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

import cffi
import nacl.bindings
import nacl.signing

from schemas.errors import KeyFileError, SignatureError
from schemas.file_modes import warn_if_exposed

HEADER_KEY: Final = "Fleet-Key"
HEADER_SIG: Final = "Fleet-Sig"

_PREFIX_SEED: Final = 18 << 3  # base32 'S'
_PREFIX_USER: Final = 20 << 3  # base32 'U'


def _crc16(data: bytes) -> int:
    """CRC-16/XMODEM, the checksum nkeys append to every encoded key: ``binascii``'s
    CRC-CCITT from 0 is exactly that, in C (the bitwise loop in Python cost more than
    the signature check a new key is decoded for)."""
    return binascii.crc_hqx(data, 0)


_BASE32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
_BASE32_AS_DIGITS = str.maketrans(_BASE32, "0123456789ABCDEFGHIJKLMNOPQRSTUV")
"""RFC 4648's base32 alphabet onto the digits ``int(text, 32)`` reads, letter for letter."""
_BASE32_TEXT = re.compile(f"[{_BASE32}]+")


def _b32decode(text: str) -> bytes:
    """RFC 4648 base32 without its padding, as nkeys are written. A text of whole 8-letter
    groups (a public key is 56 letters) is read as one base-32 number, 2 µs where
    ``base64.b32decode``'s loop takes 12 (an aggregator decodes every node's key once,
    100,000 of them in a cold start); any other text, and any letter outside the
    alphabet, goes to ``base64.b32decode``, which answers exactly the same
    (tests/schemas/test_subjects_signing.py)."""
    if len(text) % 8 == 0 and _BASE32_TEXT.fullmatch(text):
        return int(text.translate(_BASE32_AS_DIGITS), 32).to_bytes(len(text) * 5 // 8, "big")
    padded = text + "=" * (-len(text) % 8)
    return base64.b32decode(padded)


def _encode(raw: bytes) -> str:
    return base64.b32encode(raw + _crc16(raw).to_bytes(2, "little")).decode().rstrip("=")


def _checked(text: str) -> bytes:
    raw = _b32decode(text)
    body, crc = raw[:-2], raw[-2:]
    if _crc16(body).to_bytes(2, "little") != crc:
        raise ValueError("checksum mismatch")
    return body


def public_key_bytes(public_key: str) -> bytes:
    """The 32 raw Ed25519 bytes of a user nkey (``U...``); ValueError if it is not one."""
    try:
        body = _checked(public_key)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not an nkey: {exc}") from None
    if len(body) != 33 or body[0] != _PREFIX_USER:
        raise ValueError("not a user nkey (U...)")
    return body[1:]


def fingerprint(public_key: str) -> str:
    """``SHA256:<base64>`` of the raw public key, as ssh shows host keys: short enough to
    compare by eye before approving a key read from the network."""
    digest = hashlib.sha256(public_key_bytes(public_key)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def is_seed(text: str) -> bool:
    """Whether ``text`` is a user nkey seed (``SU...``): a secret pasted where a public
    key belongs, to be refused with that said rather than as a malformed key."""
    try:
        KeyPair(text)
    except ValueError:
        return False
    return True


class KeyPair:
    """A node's or operator's Ed25519 key pair, stored as an nkey user seed (``SU...``)."""

    def __init__(self, seed: str) -> None:
        try:
            body = _checked(seed.strip())
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"not an nkey seed: {exc}") from None
        prefix = ((body[0] & 7) << 5) | ((body[1] & 248) >> 3)
        if len(body) != 34 or body[0] & 248 != _PREFIX_SEED or prefix != _PREFIX_USER:
            raise ValueError("not a user nkey seed (SU...)")
        self._signing_key = nacl.signing.SigningKey(body[2:])
        self.seed = seed.strip()
        self.public_key = _encode(bytes([_PREFIX_USER]) + bytes(self._signing_key.verify_key))

    @classmethod
    def generate(cls) -> KeyPair:
        raw = os.urandom(32)
        header = bytes([_PREFIX_SEED | _PREFIX_USER >> 5, (_PREFIX_USER & 31) << 3])
        return cls(_encode(header + raw))

    def sign(self, body: bytes) -> bytes:
        return self._signing_key.sign(body).signature

    def headers(self, body: bytes) -> dict[str, str]:
        """The two signature headers for ``body``."""
        return {
            HEADER_KEY: self.public_key,
            HEADER_SIG: base64.b64encode(self.sign(body)).decode(),
        }


def verify(headers: Mapping[str, str] | None, body: bytes) -> str:
    """Check the signature headers over ``body``; return the signer's public key. Any
    malformed header (not ASCII, not an nkey, not base64, wrong length) raises
    SignatureError, never anything else: headers come from whoever published."""
    if not headers or HEADER_KEY not in headers or HEADER_SIG not in headers:
        raise SignatureError("missing Fleet-Key or Fleet-Sig header")
    public_key = headers[HEADER_KEY]
    verify_with(verify_key(public_key), public_key, headers, body)
    return public_key


def verify_key(public_key: str) -> bytes:
    """The raw 32-byte Ed25519 key of ``public_key``, decoded once per key by a verifier
    that keeps it (base32, the checksum and the prefix checked: a few µs; the bytes are a
    third of a ``VerifyKey`` object, which an aggregator keeps per node)."""
    try:
        return public_key_bytes(public_key)
    except ValueError as exc:
        raise SignatureError(f"bad Fleet-Key: {exc}", public_key[:64]) from None


def verify_with(key: bytes, public_key: str, headers: Mapping[str, str], body: bytes) -> None:
    """:func:`verify` with the signer's raw key (:func:`verify_key`) already decoded from
    ``public_key``."""
    if HEADER_SIG not in headers:
        raise SignatureError("missing Fleet-Key or Fleet-Sig header")
    try:
        # ValueError covers binascii.Error and non-ASCII text (b64decode's own check).
        signature = base64.b64decode(headers.get(HEADER_SIG, ""), validate=True)
    except ValueError:
        raise SignatureError("Fleet-Sig is not base64", public_key) from None
    if len(signature) != 64:
        raise SignatureError("Fleet-Sig is not 64 bytes", public_key)
    if len(key) != nacl.bindings.crypto_sign_PUBLICKEYBYTES:  # C reads 32 bytes from it
        raise SignatureError("Fleet-Key is not a 32-byte Ed25519 key", public_key)
    if sodium_verify_detached(signature, body, len(body), key) != 0:
        raise SignatureError("signature does not match the body", public_key)


def sodium_verify_detached(signature: bytes, body: bytes, length: int, key: bytes) -> int:
    """libsodium's ``crypto_sign_verify_detached`` (:func:`_load_detached_verify`): 0 when
    ``signature`` is ``key``'s over ``body``."""
    return _load_detached_verify()(signature, body, length, key)


@functools.cache
def _load_detached_verify() -> Callable[[bytes, bytes, int, bytes], int]:
    """libsodium's ``crypto_sign_verify_detached``, from the library PyNaCl itself loaded
    (its wheels build libsodium into ``nacl._sodium``; one linked to a system libsodium
    finds it there through the same handle). PyNaCl offers the check only as
    ``crypto_sign_open``, which first copies signature and body into one new buffer and
    then the body out into another: for a 4 KB heartbeat those cost 2-6 % of an
    aggregator's CPU per heartbeat (three runs side by side: 6.3, 4.8, 2.0 %). Both end
    in the same libsodium check (``crypto_sign_ed25519_open`` runs this function's body
    on the same bytes), so they accept and refuse exactly the same signatures
    (tests/schemas/test_subjects_signing.py compares them). Loaded at the first check,
    not at import: declaring it parses C (pycparser), which every process that imports
    the schemas, ``fleetctl --version`` included, paid at start."""
    ffi = cffi.FFI()
    ffi.cdef(
        "int crypto_sign_verify_detached(const unsigned char *sig, const unsigned char *m,"
        " unsigned long long mlen, const unsigned char *pk);"
    )
    sodium = importlib.util.find_spec("nacl._sodium")
    assert sodium is not None and sodium.origin is not None  # loaded by nacl.bindings
    library = ffi.dlopen(sodium.origin)
    function: Callable[[bytes, bytes, int, bytes], int]
    function = library.crypto_sign_verify_detached  # type: ignore[attr-defined]  # cdef'd
    return function


def create_key_file(path: Path) -> KeyPair:
    """Write a new seed to ``path`` (mode 0600); refuses to overwrite an existing key. A
    directory created for it is 0700, so nobody else can even list the keys."""
    pair = KeyPair.generate()
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(str(path), "already exists; refusing to overwrite a key") from None
    except OSError as exc:
        raise KeyFileError(str(path), exc.strerror or str(exc)) from None
    with os.fdopen(fd, "w") as handle:
        handle.write(pair.seed + "\n")
    return pair


def load_key_file(path: Path) -> KeyPair:
    """The key pair in ``path``; a file that group or others may access still loads (so a
    fleet is not cut off by a chmod) but is warned about loudly: its seed is the identity."""
    try:
        seed = path.read_text().strip()
    except FileNotFoundError:
        raise KeyFileError(str(path), "not found (create it with 'init')") from None
    except OSError as exc:
        raise KeyFileError(str(path), exc.strerror or str(exc)) from None
    warn_if_exposed(path, "key")
    try:
        return KeyPair(seed)
    except ValueError as exc:
        raise KeyFileError(str(path), str(exc)) from None


def load_or_create_key_file(path: Path) -> KeyPair:
    if path.exists():
        return load_key_file(path)
    return create_key_file(path)
