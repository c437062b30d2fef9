"""Print the release matrix in full: `python -m tools.derived_table [VERSION...] > table.txt`.

One line per fact, sorted the same way every time, so that two printouts diff cleanly:

    0.5.19 apply pr36988 applied                          what the engine does with each fix
    0.5.19 pristine admission/valid_request_admitted safe  every registered case, on both trees
    0.5.19 patched admission/valid_request_admitted safe
    0.5.19 exit 0                                          what `run` is expected to exit with

Every case of every measured release is printed, `safe` ones included: this is the table the
matrix tests check the real trees against (`Release.expected`, `Release.apply` through
backport/releases.py), so a change to how expectations are written down or derived shows up
here as a diff a reviewer can read. It reads the matrix only: nothing is fetched or probed.
"""

from __future__ import annotations

import sys

import probes
from backport import evidence
from backport.releases import load_releases

ROLES = ("pristine", "patched")


def case_keys() -> list[tuple[str, bool]]:
    """(probe/case, must_preserve) for every registered case, in registration order."""
    return [(f"{c.probe}/{c.name}", c.must_preserve) for p in probes.PROBE_NAMES for c in probes.cases_of(p)]


def table(versions: list[str] | None = None) -> list[str]:
    releases = load_releases()
    keys = case_keys()
    lines = []
    for version, release in releases.items():
        if not release.measured or (versions and version not in versions):
            continue
        lines += [f"{version} apply {fix} {status}" for fix, status in release.apply.items()]
        for role in ROLES:
            lines += [f"{version} {role} {key} {release.expected(role, key)}" for key, _ in keys]
        finding = any(evidence.is_finding(evidence.pair_verdict(release.expected("pristine", key),
                                                                release.expected("patched", key)), must)
                      for key, must in keys)
        lines.append(f"{version} exit {1 if finding else 0}")
    return lines


def main(argv: list[str]) -> int:
    sys.stdout.write("".join(line + "\n" for line in table(argv or None)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
