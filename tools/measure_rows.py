"""Measure release-matrix rows: `python -m tools.measure_rows 0.5.19 0.5.20 ...`.

Fetches each release, applies the pack to a fresh clone, probes the pristine and patched trees in
one probe matrix, and compares what ran with what the rule derives (backport/expectations.py,
without the row's exceptions). It prints, per release, the exceptions the row needs (in the form
patches/releases.toml holds them, with a reason to fill in) and whether the row states exactly
those. A developer reviews the printout and edits the row (this never writes the matrix: an
exception is a decision with a reason, not an output). Exit 1 when a measured row disagrees.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from backport import expectations
from backport.engine import apply_series
from backport.pack import load_pack
from backport.probing import ensure_env, run_matrix
from backport.releases import load_releases
from backport.resources import pack_dir
from backport.sources import materialise
from backport.tree import clone_tree


def needed_exceptions(
    pack, version: str, apply: dict[str, str], observed: dict[tuple[str, str], str]
) -> list[str]:
    """The exception lines a row needs so that the rule plus them equals what ran."""
    rule = expectations.derive(pack, version)
    lines = [f'{{ fix = "{fix}", apply = "{status}", reason = "..." }}'
             for fix, status in apply.items() if rule.apply.get(fix) != status]
    # the rule with the measured apply outcome: only case verdicts the outcome does not explain
    stated = [expectations.StatedException("measured", fix=fix, apply=status)
              for fix, status in apply.items() if rule.apply.get(fix) != status]
    rule = expectations.derive(pack, version, stated)
    for rule_case in expectations.case_rules():
        key = rule_case.key
        differs = {role: observed[(role, key)] for role in expectations.ROLES
                   if observed[(role, key)] != rule.verdicts[(role, key)]}
        if differs:
            roles = ", ".join(f'{role} = "{verdict}"' for role, verdict in differs.items())
            lines.append(f'{{ case = "{key}", {roles}, reason = "..." }}')
    return lines


def stated_lines(release) -> list[str]:
    out = []
    for exc in release.exceptions:
        if exc.fix is not None:
            out.append(f'{{ fix = "{exc.fix}", apply = "{exc.apply}", reason = "..." }}')
        else:
            roles = ", ".join(f'{role} = "{getattr(exc, role)}"' for role in expectations.ROLES
                              if getattr(exc, role) is not None)
            out.append(f'{{ case = "{exc.case}", {roles}, reason = "..." }}')
    return out


def main(versions: list[str]) -> int:
    releases = load_releases()
    pack = load_pack(pack_dir())
    python = str(ensure_env())
    roots, reports = [], {}
    disagree = 0
    with tempfile.TemporaryDirectory(prefix="measure-rows-") as tmp:
        for version in versions:
            pristine = materialise(f"sglang=={version}").tree
            patched = clone_tree(pristine, Path(tmp))
            reports[version] = apply_series(patched.path, pack, version)
            roots += [pristine.package_root, patched.package_root]
        docs = iter(run_matrix(python, roots))
        for version in versions:
            observed = {}
            for role in expectations.ROLES:
                doc = next(docs)
                observed.update({(role, f"{c['probe']}/{c['case']}"): c["verdict"] for c in doc["cases"]})
            apply = {p.fix: p.status for p in reports[version].patches}
            need = needed_exceptions(pack, version, apply, observed)
            row = releases.get(version)
            print(f"# {version}: apply {reports[version].status}; {len(need)} exception(s) needed")
            print("exceptions = [\n" + "".join(f"    {line},\n" for line in need) + "]" if need else "(none)")
            if row is not None and row.measured:
                same = sorted(need) == sorted(stated_lines(row))
                disagree += not same
                print("#   the row states exactly these" if same
                      else "#   the row states: " + ("; ".join(stated_lines(row)) or "none"))
            print()
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
