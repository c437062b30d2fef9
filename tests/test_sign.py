"""Signed receipts: `sign BUNDLE --key KEY` and `verify BUNDLE --key PUB`, with keys made by openssl."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from backport import cli, evidence
from backport.evidence import sign
from tests.test_evidence import fixture_run


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture
def keys(tmp_path) -> tuple[Path, Path, Path]:
    """(private, its public, another key's public): PKCS#8 PEM as openssl writes them."""
    private, public, other, other_public = (tmp_path / n for n in ("k.pem", "k.pub", "o.pem", "o.pub"))
    _openssl("genpkey", "-algorithm", "ed25519", "-out", str(private))
    _openssl("pkey", "-in", str(private), "-pubout", "-out", str(public))
    _openssl("genpkey", "-algorithm", "ed25519", "-out", str(other))
    _openssl("pkey", "-in", str(other), "-pubout", "-out", str(other_public))
    assert private.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    return private, public, other_public


@pytest.fixture
def bundle(tmp_path) -> Path:
    return evidence.write_bundle(tmp_path / "bundle", fixture_run(tmp_path / "run"))


def test_sign_then_verify_with_the_key(bundle, keys, capsys):
    private, public, _ = keys
    assert cli.main(["verify", str(bundle)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("; unsigned")
    assert cli.main(["sign", str(bundle), "--key", str(private)]) == 0
    envelope = json.loads((bundle / "receipt.dsse.json").read_text())
    assert envelope["payloadType"] == "application/vnd.in-toto+json" and len(envelope["signatures"]) == 1
    capsys.readouterr()
    assert cli.main(["verify", str(bundle), "--key", str(public)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("; signature verified")
    # The envelope is not in SHA256SUMS, so a signed bundle still verifies without the key.
    assert cli.main(["verify", str(bundle), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["signature"].startswith("signed, signature not checked")


def test_another_key_or_no_envelope_fails_naming_the_envelope(bundle, keys, capsys):
    private, public, other_public = keys
    assert cli.main(["verify", str(bundle), "--key", str(public)]) == 1
    assert capsys.readouterr().out.startswith("FAIL receipt.dsse.json: missing")
    sign.sign_bundle(bundle, private)
    assert cli.main(["verify", str(bundle), "--key", str(other_public), "--json"]) == 1
    first = json.loads(capsys.readouterr().out)["first"]
    assert first["file"] == "receipt.dsse.json" and "no signature verifies" in first["detail"]


def test_every_edited_byte_of_the_envelope_fails(bundle, keys):
    private, public, _ = keys
    signed = sign.sign_bundle(bundle, private)
    key = sign.load_public_key(public)
    raw = signed.envelope.read_bytes()
    assert sign.envelope_problems(bundle, key) == []
    # Every byte of the signature and key id, the type, the last base64 chars, and a sample of the rest.
    text = raw.decode()
    positions = set(range(0, len(raw), 11)) | set(range(len(raw) - 220, len(raw)))
    positions |= {text.index("application"), text.index('"payload":') + 12 + 40}
    for i in sorted(p for p in positions if 0 <= p < len(raw)):
        for replacement in {raw[i] ^ 0x01, ord("A") if raw[i] != ord("A") else ord("B")}:
            signed.envelope.write_bytes(raw[:i] + bytes([replacement]) + raw[i + 1:])
            problems = sign.envelope_problems(bundle, key)
            assert problems and problems[0].file == "receipt.dsse.json", (i, chr(raw[i]), chr(replacement))
    signed.envelope.write_bytes(raw)
    assert sign.envelope_problems(bundle, key) == []


def test_a_receipt_edited_after_signing_fails(bundle, keys, capsys):
    private, public, _ = keys
    sign.sign_bundle(bundle, private)
    receipt = json.loads((bundle / "receipt.json").read_text())
    receipt["predicate"]["summary"]["result"] = "pass"
    (bundle / "receipt.json").write_bytes(evidence.canonical_json(receipt) + b" ")
    assert cli.main(["verify", str(bundle), "--key", str(public)]) == 1


def test_bad_keys_are_bad_input(bundle, keys, tmp_path, capsys):
    private, public, _ = keys
    encrypted = tmp_path / "enc.pem"
    _openssl("pkey", "-in", str(private), "-aes256", "-passout", "pass:secret", "-out", str(encrypted))
    assert cli.main(["sign", str(bundle), "--key", str(encrypted)]) == 2
    assert "encrypted private key" in capsys.readouterr().err
    assert cli.main(["sign", str(bundle), "--key", str(public)]) == 2  # a public key cannot sign
    assert cli.main(["verify", str(bundle), "--key", str(private)]) == 2  # nor a private one verify
    assert cli.main(["sign", str(tmp_path), "--key", str(private)]) == 2
    assert not (bundle / "receipt.dsse.json").exists()


def test_a_bundle_that_does_not_verify_is_not_signed(bundle, keys, capsys):
    private, _, _ = keys
    (bundle / "REPORT.md").write_text("edited\n")
    assert cli.main(["sign", str(bundle), "--key", str(private)]) == 1
    assert not (bundle / "receipt.dsse.json").exists()


def _reseal(bundle: Path) -> None:
    """SHA256SUMS recomputed over the bundle's files as they now are (what a tamperer does)."""
    import hashlib

    sums = bundle / "SHA256SUMS"
    names = [line.split("  ", 1)[1] for line in sums.read_text().splitlines()]
    sums.write_text("".join(f"{hashlib.sha256((bundle / n).read_bytes()).hexdigest()}  {n}\n" for n in names))


def test_a_receipt_edited_and_resealed_after_signing_fails_plain_verify(bundle, keys, capsys):
    """No key is needed to see that the envelope signs other bytes than receipt.json: the receipt
    edited, REPORT.md re-rendered and SHA256SUMS recomputed hide it from every other check."""
    import hashlib

    from backport.evidence.report import render_report
    from backport.evidence.table import attached_from

    private, _, _ = keys
    sign.sign_bundle(bundle, private)
    assert cli.main(["verify", str(bundle)]) == 0
    capsys.readouterr()
    receipt = json.loads((bundle / "receipt.json").read_text())
    receipt["predicate"]["toolkit"]["version"] = "9.9.9"
    report = render_report(attached_from(bundle, receipt)).encode()
    receipt["predicate"]["files"]["REPORT.md"] = hashlib.sha256(report).hexdigest()
    (bundle / "receipt.json").write_bytes(evidence.canonical_json(receipt))
    (bundle / "REPORT.md").write_bytes(report)
    _reseal(bundle)
    assert cli.main(["verify", str(bundle), "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["integrity"] == "failed" and document["first"]["file"] == "receipt.dsse.json", document[
        "first"
    ]
    assert "signs another receipt" in document["first"]["detail"]
    # the same edit on an unsigned bundle passes: the envelope is what shows it
    for path in [bundle / "receipt.dsse.json", *bundle.rglob("*.intoto.jsonl")]:
        path.unlink()
    assert cli.main(["verify", str(bundle)]) == 0


def test_plain_verify_checks_the_attestations_subjects_without_a_key(bundle, keys, capsys):
    private, _, _ = keys
    sign.sign_bundle(bundle, private)
    lines = bundle / "receipt.intoto.jsonl"
    lines.write_bytes(
        lines.read_bytes().replace(b"application/vnd.in-toto+json", b"application/x-other+json")
    )
    assert cli.main(["verify", str(bundle), "--json"]) == 1
    first = json.loads(capsys.readouterr().out)["first"]
    assert first["file"] == "receipt.intoto.jsonl" and "payload type" in first["detail"]
