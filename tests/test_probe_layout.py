"""The probe package's layout (issue 46 item 3): moving or splitting a probe module never renames a
case. Bundles (probes/*.json), `sglang-backport probe --json` and the release matrix name each case
`probe/case`; tests/fixtures/probe-case-ids.txt is that list, in registration order, as the registry
gave it before probes/ was sorted into cases/, rigs/, standins/ and runtime/ (a new case is added to it
where the registry lists it; an id once there is never renamed)."""

from __future__ import annotations

import ast
from pathlib import Path

import probes

REPO = Path(__file__).resolve().parent.parent
IDS = REPO / "tests" / "fixtures" / "probe-case-ids.txt"


def test_case_ids_are_unchanged():
    ids = [f"{c.probe}/{c.name}" for p in probes.PROBE_NAMES for c in probes.cases_of(p)]
    assert ids == IDS.read_text().split()
    assert sorted(probes.REGISTRY) == sorted(probes.PROBE_NAMES)  # no case registers under a stray name


def _imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Every module `path` imports (absolute, or relative resolved against its package), at any depth
    (the probes import lazily inside functions too)."""
    if package is None:
        package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from probes.cases import x`
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(node.args[0].value)
    return found


def test_no_case_module_imports_another():
    """What two probes (or two scenario modules of one probe) share is a rig or a stand-in: a case module
    imports no module under probes/cases/ (a probe package's __init__ imports its scenarios by name
    through importlib, from an f-string this walk does not read)."""
    offenders = {}
    for path in sorted((REPO / "probes" / "cases").rglob("*.py")):
        cases = {m for m in _imported_modules(path) if m == "probes.cases" or m.startswith("probes.cases.")}
        if cases:
            offenders[str(path.relative_to(REPO))] = sorted(cases)
    assert not offenders


def test_the_walk_sees_a_case_import(tmp_path):
    """The import walk above is not vacuous: it reports every spelling a case import could take."""
    probe = tmp_path / "probe.py"
    probe.write_text("from probes.cases.flush_holds import x\nimport probes.cases.handoff\n"
                     "def f():\n    from .reentry import y\n    from probes.cases import tree_release\n")
    seen = _imported_modules(probe, "probes.cases.admission")
    assert {"probes.cases.flush_holds", "probes.cases.handoff", "probes.cases.admission.reentry",
            "probes.cases.tree_release"} <= seen


def test_every_probe_module_has_a_kind():
    """probes/ holds only its package __init__ and requirements; every module is a case, a rig, a
    stand-in or part of the child's runtime."""
    loose = sorted(p.name for p in (REPO / "probes").glob("*.py") if p.name != "__init__.py")
    assert not loose
    kinds = {p.name for p in (REPO / "probes").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert kinds == {"cases", "rigs", "standins", "runtime"}


def test_probe_modules_stay_small():
    """Modules under ~400 lines (the shims are stand-in packages of their own, left out)."""
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for p in (REPO / "probes").rglob("*.py") if "shims" not in p.parts}
    assert {path: n for path, n in sizes.items() if n > 400} == {}


def _module_file(name: str) -> Path | None:
    path = REPO.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_probe_import_resolves():
    """Every `probes...` import in the probes, the tests and the benchmarks (lazy ones too) names a
    module of the package or a name its parent defines: a module moved by kind leaves no stale import
    (the matrix child once kept `from probes import harness` and every matrix run exited 1)."""
    stale = []
    for folder in ("probes", "tests", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if "shims" in path.parts:
                continue
            for name in sorted(m for m in _imported_modules(path) if m.split(".")[0] == "probes"):
                parent, _, last = name.rpartition(".")
                if _module_file(name) is None and not (
                        parent and (found := _module_file(parent)) and last in _top_level_names(found)):
                    stale.append(f"{path.relative_to(REPO)}: {name}")
    assert not stale
