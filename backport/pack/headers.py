"""DEP-3 patch headers: the fields before the diff, and their agreement with
``fixes.toml``.

A patch file is a header (``Field: value``, continuation lines start with a
space; a continuation of a lone ``.`` is an empty line) ended by a line
``---``, then the diff. Required fields: Description, Origin, Applies-To,
Depends-On, Last-Update (YYYY-MM-DD); optional: Backport-Notes, Bug.

``fixes.toml`` is the one source of a fix's metadata. The header restates
some of it for people reading the patch alone; when it does, it must say the
same thing: the URLs in Origin are the fix's ``url`` (or a commit URL of its
``upstream_commit``), Bug is its ``bug`` (the report; the ``url`` when
fixes.toml names no report), the ``commit X`` in Origin or Applied-Upstream is
its ``upstream_commit`` (abbreviated or not), Applied-Upstream's release is the
first release of its ``fixed_in``, and Depends-On names its ``depends_on`` and
may add a fix that this variant's context builds on in its releases only (the
engine requires both). Anything else is bad input naming both values.

Origin's first word says what the variant is (DEP-3): ``backport`` for an
upstream fix whose added lines are this project's own, written for the release
(the pack's variants, with Backport-Notes of the differences), ``upstream``
for upstream's patch as is, ``vendor`` for this pack's own fix (no release has
it, so no Applied-Upstream).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import BadInput
from .model import FIX_ID, Fix

REQUIRED_FIELDS = ("Description", "Origin", "Applies-To", "Depends-On", "Last-Update")
OPTIONAL_FIELDS = ("Backport-Notes", "Bug", "Applied-Upstream")
UPSTREAM_KINDS = ("backport", "upstream")
_FIELD = re.compile(r"^([A-Za-z][A-Za-z0-9-]*):(.*)$")
_URL = re.compile(r"https?://[^\s,;]+")
_COMMIT_WORD = re.compile(r"\bcommit\s+([0-9A-Za-z]+)")
_COMMIT_URL = re.compile(r"/commit/([0-9a-fA-F]{7,40})$")


def parse_header(text: str, where: str) -> tuple[dict[str, str], str]:
    """Split a patch file into its DEP-3 header fields and the diff text."""
    lines = text.splitlines(keepends=True)
    fields: dict[str, str] = {}
    canon = {f.lower(): f for f in REQUIRED_FIELDS + OPTIONAL_FIELDS}
    cur: str | None = None
    for i, raw in enumerate(lines):
        line = raw.rstrip("\r\n")
        if line.rstrip() == "---":
            body = "".join(lines[i + 1:])
            break
        if not line.strip():
            cur = None
            continue
        if line[0] in " \t":
            if cur is None:
                raise BadInput(f"{where}:{i + 1}: continuation line without a field")
            cont = line.strip()
            fields[cur] += "\n" + ("" if cont == "." else cont)
            continue
        m = _FIELD.match(line)
        if not m and line.startswith(("--- ", "+++ ", "diff ", "@@", "Index: ")):
            raise BadInput(f"{where}: no '---' line ends the header before the diff at line {i + 1}")
        if not m:
            raise BadInput(f"{where}:{i + 1}: header line is not 'Field: value': {line[:60]!r}")
        name = canon.get(m.group(1).lower(), m.group(1))
        if name in fields:
            raise BadInput(f"{where}:{i + 1}: field {name} given twice")
        fields[name] = m.group(2).strip()
        cur = name
    else:
        raise BadInput(f"{where}: no '---' line ends the header")
    missing = [f for f in REQUIRED_FIELDS if not fields.get(f, "").strip()]
    if missing:
        raise BadInput(f"{where}: missing header field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    return fields, body


def parse_ids(value: str, where: str, what: str) -> tuple[str, ...]:
    """A comma-separated list of fix ids; "none", "-" or empty: no ids."""
    value = value.strip()
    if value.lower() in ("", "none", "-"):
        return ()
    out = tuple(x.strip() for x in value.split(",") if x.strip())
    for x in out:
        if not FIX_ID.match(x):
            raise BadInput(f"{where}: {what} names {x!r}, not a fix id")
    return out


def _same_commit(a: str, b: str) -> bool:
    """Equal, or one an abbreviation of the other (hex, at least 7 digits)."""
    a, b = a.lower(), b.lower()
    if a == b:
        return True
    short, full = sorted((a, b), key=len)
    return len(short) >= 7 and re.fullmatch(r"[0-9a-f]+", full) is not None and full.startswith(short)


def check_agreement(header: Mapping[str, str], depends_on: tuple[str, ...], fix: Fix, where: str) -> None:
    """Raise BadInput when the header restates the fix's metadata differently."""
    origin = header.get("Origin", "")
    first = origin.strip().split(",", 1)[0].strip().lower()
    if first != "vendor" and first not in UPSTREAM_KINDS:
        raise BadInput(f"{where}: Origin starts with {first!r}, not backport, upstream or vendor")
    kind = "vendor" if first == "vendor" else "upstream"
    if kind != fix.origin:
        raise BadInput(f"{where}: Origin says {first}, fixes.toml [{fix.id}] origin is {fix.origin}")
    for url in _URL.findall(origin):
        url = url.rstrip(".)")
        commit_url = _COMMIT_URL.search(url)
        if commit_url and _same_commit(commit_url.group(1), fix.upstream_commit):
            continue
        if url != fix.url:
            raise BadInput(f"{where}: Origin names {url}, fixes.toml [{fix.id}] url is {fix.url}")
    word = _COMMIT_WORD.search(origin)
    if word and not _same_commit(word.group(1), fix.upstream_commit):
        raise BadInput(f"{where}: Origin names commit {word.group(1)}, "
                       f"fixes.toml [{fix.id}] upstream_commit is {fix.upstream_commit}")
    bug = header.get("Bug", "").strip()
    report = fix.bug or fix.url
    if bug and bug != report:
        raise BadInput(
            f"{where}: Bug is {bug}, fixes.toml [{fix.id}] {'bug' if fix.bug else 'url'} is {report}"
        )
    _check_applied_upstream(header.get("Applied-Upstream", "").strip(), fix, where)
    if not set(fix.depends_on) <= set(depends_on):
        said = ", ".join(depends_on) or "none"
        toml = ", ".join(fix.depends_on) or "none"
        raise BadInput(f"{where}: Depends-On is {said}, fixes.toml [{fix.id}] depends_on is {toml}")


def _check_applied_upstream(value: str, fix: Fix, where: str) -> None:
    """`Applied-Upstream: <release>, commit <sha>`: the first release of fixed_in and the upstream commit."""
    if not value:
        return
    if fix.is_vendor:
        raise BadInput(f"{where}: Applied-Upstream on this pack's own fix [{fix.id}], which no release has")
    release = value.split(",", 1)[0].strip()
    if release != fix.first_release:
        raise BadInput(f"{where}: Applied-Upstream names release {release}, fixes.toml [{fix.id}] fixed_in "
                       f"{fix.fixed_in} starts at {fix.first_release}")
    word = _COMMIT_WORD.search(value)
    if word is None:
        raise BadInput(f"{where}: Applied-Upstream {value!r} is not '<release>, commit <sha>'")
    if not _same_commit(word.group(1), fix.upstream_commit):
        raise BadInput(f"{where}: Applied-Upstream names commit {word.group(1)}, "
                       f"fixes.toml [{fix.id}] upstream_commit is {fix.upstream_commit}")
