"""No untyped stage boundary in job/, evidence/, live/, audit/ (issue 46 item 1): a public function of
those packages that a module of another package calls takes and returns typed values (frozen
dataclasses, StrEnums, scalars, containers of those), not JSON dicts. The rule (docs/decisions.md,
"Typed stage boundaries"):

- the functions: module-level, public (no leading underscore), defined in backport/{job,evidence,
  live,audit}/ (the stand-ins excepted: they run in the servers' interpreter), and referenced from a
  backport module outside their own package, by name (`from backport.evidence.x import f`, also through
  the package's re-export) or as an attribute of an imported module or package (`evidence.f`);
- untyped: a parameter (self/cls aside) or return with no annotation, or one whose annotation holds
  `Any` or a bare `dict` anywhere (`dict`, `dict | None`, `list[dict]`, `dict[str, dict]`); a fully
  parameterised mapping of typed values (`dict[str, TreeInput]`, `dict[str, str]`) is typed;
- allowed: EDGES, where JSON is the point (a bundle file or the receipt read or written as the document it
  is), each with its reason; and LEFT, what is not converted yet, each with its reason. LEFT only
  shrinks: an entry that no longer breaks the rule fails the test, so it is taken off when converted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "backport"
PACKAGES = ("job", "evidence", "live", "audit")
SKIP = ("backport/live/standins/",)

# JSON is the point: the function reads or writes a bundle file or the receipt as the document it is.
EDGES: dict[str, str] = {
    "backport.evidence.artifacts.tree_digest": "reads a subject of a receipt read back (formats 3 and 4)",
    "backport.evidence.scope.covers_line": "reads predicate.cases of a receipt (`run` prints it)",
    "backport.evidence.scope.receipt_apply": "reads predicate.apply of a receipt (any bundle format) into "
                                             "the ApplyReport record",
    "backport.evidence.scope.reference_comparison": "reads predicate.cases of a receipt (`run` prints it)",
    "backport.evidence.verify.finding_reason": "reads predicate.summary of a verified receipt",
    "backport.evidence.merge.merge": "the merged summary, written as merged.json and printed by --json",
    "backport.evidence.merge.shards": "returns the CI matrix, printed as JSON for the workflow",
}

# Not converted yet (shrinks): what each would become.
LEFT: dict[str, str] = {}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")


def _skipped(path: Path) -> bool:
    return path.relative_to(ROOT.parent).as_posix().startswith(SKIP)


def _untyped(node: ast.expr | None) -> bool:
    if node is None:
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        return _untyped(ast.parse(node.value, mode="eval").body)
    subscripted = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Subscript)}
    for n in ast.walk(node):
        if (isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any"):
            return True
        if isinstance(n, ast.Name) and n.id in ("dict", "Dict") and id(n) not in subscripted:
            return True
        if n is not node and isinstance(n, ast.Constant) and isinstance(n.value, str) and _untyped(n):
            return True
    return False


def _functions() -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if _skipped(path):
                continue
            for node in ast.parse(path.read_text(), str(path)).body:
                function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                if function and not node.name.startswith("_"):
                    found[f"{_module(path)}.{node.name}"] = node
    return found


def _references() -> dict[str, set[str]]:
    """Every dotted name a backport module refers to (imports, attributes of imported names): its modules."""
    refs: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if _skipped(path):
            continue
        module = _module(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        names: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{node.module}" if node.module else parent
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
        seen = set(names.values())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain, inner = [], node
                while isinstance(inner, ast.Attribute):
                    chain.append(inner.attr)
                    inner = inner.value
                if isinstance(inner, ast.Name) and inner.id in names:
                    seen.add(".".join([names[inner.id], *reversed(chain)]))
        for name in seen:
            refs.setdefault(name, set()).add(module)
    return refs


def _callers(qualified: str, refs: dict[str, set[str]]) -> set[str]:
    """The modules outside the function's package that refer to it (directly or through the package)."""
    package = ".".join(qualified.split(".")[:2])
    name = qualified.rpartition(".")[2]
    modules = refs.get(qualified, set()) | refs.get(f"{package}.{name}", set())
    return {m for m in modules if m != package and not m.startswith(package + ".")}


def _untyped_parts(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = node.args
    parts = [arg.arg for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs)
             if arg.arg not in ("self", "cls") and _untyped(arg.annotation)]
    parts += [f"*{v.arg}" for v in (a.vararg, a.kwarg) if v is not None and _untyped(v.annotation)]
    return parts + (["return"] if _untyped(node.returns) else [])


def _violations() -> dict[str, tuple[list[str], set[str]]]:
    refs = _references()
    found = {}
    for qualified, node in _functions().items():
        callers = _callers(qualified, refs)
        if callers and (parts := _untyped_parts(node)):
            found[qualified] = (parts, callers)
    return found


def test_no_untyped_stage_boundary_but_the_allowed():
    unexpected = {name: v for name, v in _violations().items() if name not in EDGES and name not in LEFT}
    assert not unexpected, "\n".join(
        f"{name}: untyped {', '.join(parts)} (called from {', '.join(sorted(callers))})"
        for name, (parts, callers) in sorted(unexpected.items())
    )


def test_the_allow_lists_only_hold_what_still_breaks_the_rule():
    """A converted function leaves LEFT (the list shrinks); an edge that became typed leaves EDGES."""
    violations = _violations()
    stale = sorted(name for name in (*EDGES, *LEFT) if name not in violations)
    assert not stale, f"no longer an untyped boundary, take off the list: {stale}"
    assert not set(EDGES) & set(LEFT)


def test_the_rule_sees_what_it_must():
    """The walker itself: a bare dict anywhere is untyped, a typed mapping is not; a call through the
    package's re-export counts (job/run.py calls `evidence.assemble`)."""
    def annotation(text: str) -> ast.expr:
        return ast.parse(text, mode="eval").body

    for text in ("dict", "dict | None", "list[dict]", "dict[str, dict]", "Any", "'dict[str, Any]'",
                 "tuple[dict, int]"):
        assert _untyped(annotation(text)), text
    for text in ("dict[str, TreeInput]", "dict[str, str]", "RunRecord", "list[tuple[str, bytes]]", "None"):
        assert not _untyped(annotation(text)), text
    refs = _references()
    assert "backport.job.run" in _callers("backport.evidence.bundle.assemble", refs)
    assert "backport.job.run" in _callers("backport.evidence.record.RunRecord", refs) or \
        "backport.job.run" in refs.get("backport.evidence.RunRecord", set())
