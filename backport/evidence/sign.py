"""Signed receipts: a DSSE envelope (the in-toto convention) over `receipt.json`.

`receipt.dsse.json` sits beside SHA256SUMS and is not listed in it: it is written after the
bundle is sealed, and its own signature covers what it says (the exact bytes of receipt.json,
which in turn names every other file by digest). Keys are PEM files, as `openssl genpkey
-algorithm ed25519` (an unencrypted PKCS#8 private key) and `openssl pkey -pubout` write
them; securesystemslib signs and verifies (ed25519, and the RSA/ECDSA keys it supports).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from backport import cache
from backport.errors import BadInput, Finding
from backport.evidence.layout import ENVELOPE, RECEIPT, canonical_json
from backport.evidence.problem import Problem

PAYLOAD_TYPE = "application/vnd.in-toto+json"


@dataclass(frozen=True)
class Signed:
    envelope: Path
    keyid: str


def _read_key(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise BadInput(f"{path}: cannot read the key ({exc.strerror})") from None


def load_signer(path: Path):
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from securesystemslib.signer import CryptoSigner

    try:
        private = load_pem_private_key(_read_key(path), password=None)
    except TypeError:
        raise BadInput(f"{path}: an encrypted private key; decrypt it first "
                       "(openssl pkey -in KEY -out PLAIN, kept somewhere safe)") from None
    except ValueError:
        raise BadInput(f"{path}: not a PEM private key (openssl genpkey -algorithm ed25519 writes one)") from None
    try:
        return CryptoSigner(private)
    except ValueError as exc:
        raise BadInput(f"{path}: unsupported key ({exc})") from None


def load_public_key(path: Path):
    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    from securesystemslib.signer import SSlibKey

    try:
        public = load_pem_public_key(_read_key(path))
    except ValueError:
        raise BadInput(f"{path}: not a PEM public key (openssl pkey -in KEY -pubout writes one)") from None
    try:
        return SSlibKey.from_crypto(public)
    except ValueError as exc:
        raise BadInput(f"{path}: unsupported key ({exc})") from None


def sign_bundle(bundle: Path, key: Path) -> Signed:
    """Sign a bundle that verifies (a bundle that does not is never signed: Finding)."""
    from securesystemslib.dsse import Envelope

    from backport.evidence.verify import verify

    signer = load_signer(key)
    result = verify(bundle)
    if not result.ok:
        raise Finding(f"{bundle}: does not verify ({result.first}); not signed")
    envelope = Envelope((Path(bundle) / RECEIPT).read_bytes(), PAYLOAD_TYPE, {})
    signature = envelope.sign(signer)
    path = Path(bundle) / ENVELOPE
    cache.write_file_atomic(path, canonical_json(envelope.to_dict()))
    return Signed(path, signature.keyid)


def signature_state(bundle: Path) -> str:
    return "signed" if (Path(bundle) / ENVELOPE).exists() else "unsigned"


def envelope_problems(bundle: Path, key) -> list[Problem]:
    """Why the bundle's envelope does not hold for `key` (an SSlibKey); [] when it does. The file
    must be the canonical form of what it parses to, so that no edited byte (whitespace, a
    base64 padding bit) passes unnoticed."""
    from securesystemslib.dsse import Envelope
    from securesystemslib.exceptions import VerificationError

    path = Path(bundle) / ENVELOPE
    if not path.is_file():
        return [Problem(ENVELOPE, "missing", "the bundle is unsigned, and --key asks for its signature")]
    raw = path.read_bytes()
    try:
        envelope = Envelope.from_dict(json.loads(raw))
        canonical = canonical_json(envelope.to_dict())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return [Problem(ENVELOPE, "inconsistent", f"not a DSSE envelope ({type(exc).__name__})")]
    if raw != canonical:
        return [Problem(ENVELOPE, "modified", "not the bytes the signer wrote (its canonical form differs)")]
    if envelope.payload_type != PAYLOAD_TYPE:
        return [Problem(ENVELOPE, "inconsistent", f"payload type {envelope.payload_type!r}, not {PAYLOAD_TYPE}")]
    try:
        envelope.verify([key], 1)
    except VerificationError:
        return [Problem(ENVELOPE, "modified", f"no signature verifies with key {key.keyid[:16]}")]
    if envelope.payload != (Path(bundle) / RECEIPT).read_bytes():
        return [Problem(ENVELOPE, "inconsistent", f"signs another receipt than this bundle's {RECEIPT}")]
    return []
