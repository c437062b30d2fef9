"""Which of a test's `types.SimpleNamespace` doubles a release's code read a missing attribute from.

Upstream's tests often drive a method unbound with a namespace standing in for `self`
(`DecodePreallocQueue.add(q, req)` with `q = SimpleNamespace(scheduler=..., ...)`). When a
later release's method reads an attribute the namespace was not given, the failure is the
double's, not the release's: `classify` calls it `stale-test`, and this module names the
double (the test helper that builds it) and what it stands for (the class whose method read it).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

NAMESPACE_TYPES = ("SimpleNamespace",)


@dataclass(frozen=True)
class Double:
    helper: str | None      # the test function that builds the namespace, when one fits
    stands_for: str | None  # Class.method of the tree whose code read the attribute

    def describe(self) -> str:
        built = f"`{self.helper}`'s types.SimpleNamespace" if self.helper else "a types.SimpleNamespace"
        return f"{built} (standing in for {self.stands_for})" if self.stands_for else built


def _namespace_builders(source: str) -> dict[str, set[str]]:
    """Test-file functions that build a SimpleNamespace: the keywords each one gives it."""
    try:
        module = ast.parse(source)
    except SyntaxError:
        return {}
    found: dict[str, set[str]] = {}
    for func in ast.walk(module):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if (isinstance(node, ast.Call) and ast.unparse(node.func).rsplit(".", 1)[-1] in NAMESPACE_TYPES
                    and node.keywords):
                found.setdefault(func.name, set()).update(k.arg for k in node.keywords if k.arg)
    return found


def _reading_function(tree_file: Path, line: int) -> tuple[str | None, set[str]]:
    """(Class.method containing `line`, the `self.X` names it reads) in a file of the tree."""
    try:
        module = ast.parse(tree_file.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None, set()
    best: tuple[str | None, ast.AST | None] = (None, None)
    for cls in (n for n in ast.walk(module) if isinstance(n, ast.ClassDef)):
        for func in cls.body:
            if (isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and func.lineno <= line <= (func.end_lineno or func.lineno)):
                best = (f"{cls.name}.{func.name}", func)
    name, found = best
    if found is None:
        return None, set()
    reads = {n.attr for n in ast.walk(found) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return name, reads


def namespace_double(source: str, package_root: Path, site: str | None) -> Double | None:
    """The double behind a missing attribute read at `site` (`sglang/...py:N`); None when the test
    builds no SimpleNamespace (then the namespace is not the test's)."""
    builders = _namespace_builders(source)
    if not builders or not site or not site.startswith("sglang/"):
        return None
    path, _, lineno = site.rpartition(":")
    stands_for, reads = _reading_function(Path(package_root) / path, int(lineno) if lineno.isdigit() else 0)
    # The helper whose namespace gives the most of what that method reads on `self` is the one
    # passed as `self` (a queue double shares the queue's attributes, a scheduler double does not).
    scored = sorted(((len(kw & reads), name) for name, kw in builders.items()), reverse=True)
    helper = (
        scored[0][1]
        if scored and scored[0][0] > 0 and (len(scored) == 1 or scored[0][0] > scored[1][0])
        else None
    )
    return Double(helper, stands_for)


def bare_instances(source: str) -> frozenset[str]:
    """Classes the test builds with `C.__new__(C)` and then fills by hand (no `__init__` ran)."""
    try:
        module = ast.parse(source)
    except SyntaxError:
        return frozenset()
    return frozenset(ast.unparse(node.func.value).rsplit(".", 1)[-1] for node in ast.walk(module)
                     if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                     and node.func.attr == "__new__")
