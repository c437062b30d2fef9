"""Every library the toolkit imports directly is declared in pyproject.toml (issue 46): a library that
arrives only through another one's requirements can disappear with that library's next release."""

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# Modules that run in another interpreter (the serving environment), not the toolkit's.
OTHER_INTERPRETER = {
    "backport/live/make_model.py": "run by the serving environment's python to make the tiny model",
}
OTHER_TREES = ("backport/live/standins/",)  # put on the servers' PYTHONPATH, never imported by the toolkit


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {canonicalize_name(Requirement(text).name) for text in project["dependencies"]}


def _toolkit_modules() -> list[Path]:
    found = []
    for path in sorted((ROOT / "backport").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in OTHER_INTERPRETER or rel.startswith(OTHER_TREES):
            continue
        found.append(path)
    return found


def test_every_third_party_import_is_declared():
    distributions = packages_distributions()
    declared = _declared()
    missing = {}
    for path in _toolkit_modules():
        for root in _imported_roots(path):
            if root in sys.stdlib_module_names or root == "backport" or root == "__future__":
                continue
            names = {canonicalize_name(d) for d in distributions.get(root, [])}
            assert names, f"{path.relative_to(ROOT)} imports {root}, which no installed distribution provides"
            if not names & declared:
                missing.setdefault(root, []).append(path.relative_to(ROOT).as_posix())
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_check_reads_real_imports():
    """The check reads real imports: gitdb (a gitpython requirement) is found in engine/objects.py."""
    roots = _imported_roots(ROOT / "backport/engine/objects.py")
    assert "gitdb" in roots
    assert {canonicalize_name(d) for d in packages_distributions()["gitdb"]} == {"gitdb"}
