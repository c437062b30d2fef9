"""Which of the lines each patch adds a probe case executed.

The lines a patch adds are found in the patched tree itself: `git blame` attributes every line
of a touched file to the commit that last changed it, and each applied patch is one commit, so
a line blamed on patch P's commit is a line P added (and no later patch rewrote). Executable
lines and executed lines come from coverage.py in the probe interpreter (the harness's
`--coverage`), measured from before `import sglang` to the last case. Lines a fix's metadata
excludes (`coverage_exclude`: code no CPU can run, each with its reason) are listed apart and
never counted as executed.

What this proves and what it does not: an executed line ran at least once under some case; it
says nothing about whether a case checked what that line does. A line not executed is code no
case reached, so no verdict rests on it.
"""

from __future__ import annotations

import re
from pathlib import Path

from backport.evidence.coverage import totals
from backport.gitops import blame_commits
from backport.pack import Pack


def touched_files(apply_json: dict | None) -> list[str]:
    """Every file (relative to the package root) an applied patch changes."""
    files = {h["file"] for p in (apply_json or {}).get("patches", []) if p.get("status") == "applied"
             for h in p.get("hunks", [])}
    return sorted(files)


def patch_coverage(tree_path: Path, package_prefix: str, apply_json: dict | None, pack: Pack,
                   probe_doc: dict, min_percent: float | None = None) -> dict:
    """The receipt's `coverage` section for the patched tree."""
    measured = probe_doc.get("coverage")
    if measured is None:
        reason = probe_doc.get("coverage_unavailable") or "the probe run recorded no coverage"
        return {"measured": False, "reason": reason, "patches": [], "totals": {}, "min_percent": min_percent}
    blame_cache: dict[str, list[str]] = {}
    patches = []
    for patch in (apply_json or {}).get("patches", []):
        if patch.get("status") != "applied" or not patch.get("commit"):
            continue
        fix = pack.fixes.get(patch["fix"])
        exclusions = fix.coverage_exclude if fix is not None else ()
        added = executed = 0
        excluded: list[dict] = []
        not_executed: list[str] = []
        for rel in sorted({h["file"] for h in patch.get("hunks", [])}):
            if rel not in blame_cache:
                blame_cache[rel] = blame_commits(tree_path, f"{package_prefix}{rel}")
            lines = (tree_path / f"{package_prefix}{rel}").read_text(errors="replace").splitlines()
            file_cov = measured.get(rel, {"statements": [], "executed": []})
            statements, ran = set(file_cov["statements"]), set(file_cov["executed"])
            for number, commit in enumerate(blame_cache[rel], 1):
                if commit != patch["commit"] or number not in statements:
                    continue
                text = lines[number - 1] if number <= len(lines) else ""
                reason = next((x.reason for x in exclusions
                               if x.file == rel and re.search(x.pattern, text)), None)
                if reason is not None:
                    excluded.append({"line": f"{rel}:{number}", "reason": reason})
                    continue
                added += 1
                if number in ran:
                    executed += 1
                else:
                    not_executed.append(f"{rel}:{number}")
        patches.append({"fix": patch["fix"], "variant": patch.get("variant"), "added": added,
                        "executed_by_probes": executed, "executed_by_upstream_tests": None,
                        "excluded": excluded, "not_executed": not_executed})
    return {"measured": True, "patches": patches, "totals": totals(patches), "min_percent": min_percent}
