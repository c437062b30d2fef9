"""The audit's "what else is open" table: one row per known advisory (patches/advisories.toml) for
each server read, or for the audited code when no server was read.

A server's row reads that server's own `/server_info` (its version, and the server arguments the
advisory's condition names); the audited code decides which advisories the code has when it is
the build the server runs (else the server's version against the ranges). With no server, the
operator's `--launch-flags` stand for the servers' arguments; with neither, an affected advisory
is `exposed-if` its condition. The rows never change the audit's exit code (docs/decisions.md).
"""

from __future__ import annotations

import shlex

from backport import advisories
from backport.audit.code import CodeFacts
from backport.audit.servers import ServerFacts
from backport.errors import BadInput
from backport.export.label import same_build
from backport.pack import Pack


def rows(pack: Pack, code: CodeFacts | None, servers: tuple[ServerFacts, ...],
         launch_flags: dict | None = None) -> list[advisories.Row]:
    known = advisories.load_for(pack)
    if not known:
        return []
    fixed = advisories.class_fixed(pack, code.package_root) if code is not None else None
    read = [s for s in servers if not s.error]
    out: list[advisories.Row] = []
    for s in read:
        matches = code is not None and s.version is not None and same_build(code.version, s.version)
        root = code.package_root if code is not None and matches else None
        for adv in known:
            out.append(
                advisories.row(
                    adv,
                    f"{s.role or 'unknown-role'} {s.url}",
                    version=s.version,
                    root=root,
                    settings=s.settings,
                    pack_fixed=fixed if matches else None,
                )
            )
    if not read and code is not None:
        out += advisories.tree_rows(known, code.how, code.package_root, code.version, fixed, launch_flags)
    return out


def parse_launch_flags(text: str) -> dict:
    """`--enable-custom-logit-processor --host 0.0.0.0 ...` (launch_server's flags) as settings:
    a flag followed by a value takes it, a bare flag is true; flags not set are false/absent."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise BadInput(f"--launch-flags: cannot split ({exc})") from None
    out: dict = {
        "enable_custom_logit_processor": False,
        "admin_api_key": False,
        "enable_pd_role_switch": False,
        "host": "127.0.0.1",
        "disaggregation_mode": "null",
    }   # launch_server's defaults
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            raise BadInput(f"--launch-flags: {word!r} is not a --flag")
        name, _, value = word[2:].partition("=")
        name = name.replace("-", "_")
        if not value and i + 1 < len(words) and not words[i + 1].startswith("--"):
            value, i = words[i + 1], i + 1
        out[name] = value if value else True
        i += 1
    return advisories.settings_of(out)
