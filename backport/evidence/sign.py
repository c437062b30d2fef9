"""Signed receipts: a DSSE envelope (the in-toto convention) over `receipt.json`.

`receipt.dsse.json` sits beside SHA256SUMS and is not listed in it: it is written after the
bundle is sealed, and its own signature covers what it says (the exact bytes of receipt.json,
which in turn names every other file by digest). The same signer writes the standard
attestations (attestations.py) as JSON Lines, one envelope a line: `receipt.intoto.jsonl` (the
receipt) and, with an exported wheel, `<wheel>.intoto.jsonl` beside it (SLSA provenance, a
test result per probed tree, the OpenVEX document). Keys are PEM files, as `openssl genpkey
-algorithm ed25519` (an unencrypted PKCS#8 private key) and `openssl pkey -pubout` write
them; securesystemslib signs and verifies (ed25519, and the RSA/ECDSA keys it supports).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from backport.errors import BadInput, Finding
from backport.evidence.layout import ENVELOPE, RECEIPT, canonical_json, write_readable
from backport.evidence.problem import Problem

if TYPE_CHECKING:  # securesystemslib is imported where used (start-up stays light)
    from securesystemslib.signer import SSlibKey

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
        raise BadInput(
            f"{path}: an encrypted private key; decrypt it first "
            "(openssl pkey -in KEY -out PLAIN, kept somewhere safe)"
        ) from None
    except ValueError:
        raise BadInput(
            f"{path}: not a PEM private key (openssl genpkey -algorithm ed25519 writes one)"
        ) from None
    try:
        return CryptoSigner(private)
    except ValueError as exc:
        raise BadInput(f"{path}: unsupported key ({exc})") from None


def load_public_key(path: Path) -> SSlibKey:
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
    receipt = (Path(bundle) / RECEIPT).read_bytes()
    envelope = Envelope(receipt, PAYLOAD_TYPE, {})
    signature = envelope.sign(signer)
    for name, payloads in attestation_payloads(Path(bundle)).items():
        lines = b"".join(_line(Envelope(payload, PAYLOAD_TYPE, {}), signer) for payload in payloads)
        write_readable(Path(bundle) / name, lines)
    path = Path(bundle) / ENVELOPE
    write_readable(path, canonical_json(envelope.to_dict()))
    return Signed(path, signature.keyid)


def _line(envelope, signer) -> bytes:
    envelope.sign(signer)
    return _compact(envelope.to_dict()) + b"\n"


def _compact(document: dict) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def attestation_payloads(bundle: Path) -> dict[str, list[bytes]]:
    """Each `*.intoto.jsonl` file of a bundle and the statements it carries, in line order, as
    the receipt, standards.json and vex.openvex.json give them."""
    from backport.evidence import attestations as att
    from backport.evidence import vex

    receipt = (bundle / RECEIPT).read_bytes()
    found = {att.RECEIPT_LINES: [receipt]}
    statement = json.loads(receipt)
    name = att.wheel_lines_name(statement)
    if name is not None and (bundle / vex.STANDARDS).is_file():
        standards = json.loads((bundle / vex.STANDARDS).read_bytes())
        document = json.loads((bundle / vex.VEX).read_bytes())
        found[name] = [att.payload_bytes(s) for s in att.wheel_statements(statement, standards, document)]
    return found


def signature_state(bundle: Path) -> str:
    return "signed" if (Path(bundle) / ENVELOPE).exists() else "unsigned"


def envelope_problems(bundle: Path, key: SSlibKey | None = None) -> list[Problem]:
    """Why the bundle's envelope does not hold for `key` (an SSlibKey); [] when it does. The file
    must be the canonical form of what it parses to, so that no edited byte (whitespace, a
    base64 padding bit) passes unnoticed. Without a key everything but the signatures is checked
    (the payload is receipt.json byte for byte, its type, every attestation and its subjects):
    none of that needs a key, and a receipt edited after signing shows there."""
    from securesystemslib.dsse import Envelope
    from securesystemslib.exceptions import VerificationError

    path = Path(bundle) / ENVELOPE
    if not path.is_file():
        if key is None:
            return []  # unsigned: said as such, nothing here to check
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
        return [
            Problem(ENVELOPE, "inconsistent", f"payload type {envelope.payload_type!r}, not {PAYLOAD_TYPE}")
        ]
    if key is not None:
        try:
            envelope.verify([key], 1)
        except VerificationError:
            return [Problem(ENVELOPE, "modified", f"no signature verifies with key {key.keyid[:16]}")]
    if envelope.payload != (Path(bundle) / RECEIPT).read_bytes():
        return [Problem(ENVELOPE, "inconsistent", f"signs another receipt than this bundle's {RECEIPT}")]
    return attestation_problems(Path(bundle), key)


def _envelope_line(name: str, number: int, raw: bytes, key):
    """(the envelope of one JSON Lines entry, None) or (None, the problem)."""
    from securesystemslib.dsse import Envelope
    from securesystemslib.exceptions import VerificationError

    where = f"{name} line {number}"
    try:
        envelope = Envelope.from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, Problem(name, "inconsistent", f"{where}: not a DSSE envelope ({type(exc).__name__})")
    if raw != _compact(envelope.to_dict()):
        return None, Problem(name, "modified", f"{where}: not the bytes the signer wrote")
    if envelope.payload_type != PAYLOAD_TYPE:
        return None, Problem(name, "inconsistent", f"{where}: payload type {envelope.payload_type!r}")
    if key is not None:
        try:
            envelope.verify([key], 1)
        except VerificationError:
            return None, Problem(
                name, "modified", f"{where}: no signature verifies with key {key.keyid[:16]}"
            )
    return envelope, None


def attestation_problems(bundle: Path, key=None) -> list[Problem]:
    """Every `*.intoto.jsonl` envelope: signed by `key` (when given), carrying exactly the statements the
    bundle gives, each a valid in-toto statement whose subjects' digests match (subject_problems)."""
    from backport.evidence import attestations as att
    from backport.evidence.layout import ATTESTATION_SUFFIX

    expected = attestation_payloads(bundle)
    problems = [
        Problem(path.relative_to(bundle).as_posix(), "unexpected", "no statement of this bundle goes here")
        for path in sorted(bundle.rglob("*" + ATTESTATION_SUFFIX))
        if path.relative_to(bundle).as_posix() not in expected
    ]
    for name, payloads in expected.items():
        path = bundle / name
        if not path.is_file():
            problems.append(
                Problem(name, "missing", "the bundle is signed, its attestations are not (sign again)")
            )
            continue
        raw = path.read_bytes()
        lines = raw.split(b"\n")
        if lines[-1] != b"" or len(lines) - 1 != len(payloads):
            problems.append(Problem(name, "inconsistent", f"holds {len(lines) - 1} line(s), the bundle gives "
                                                          f"{len(payloads)} statement(s)"))
            continue
        for number, (line, payload) in enumerate(zip(lines[:-1], payloads), 1):
            envelope, problem = _envelope_line(name, number, line, key)
            if problem is None and envelope.payload != payload:
                problem = Problem(
                    name, "inconsistent", f"line {number}: its statement is not the one the receipt gives"
                )
            if problem is None:
                document = json.loads(payload)
                messages = att.model_problems(document) + att.subject_problems(bundle, document)
                if messages:
                    problem = Problem(name, "inconsistent", f"line {number}: {messages[0]}")
            if problem is not None:
                problems.append(problem)
    return problems
