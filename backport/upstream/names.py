"""Names: what a tree defines, what the pack adds, and which name a failing test lacked.

A test that stops on a name the tree does not have is not a behaviour result. When the
name is one the pack adds (in any form: a function, class, class or instance attribute,
module constant, keyword parameter, new module) or one a fix's fingerprint names, the
tree lacks a fix and the test counts as `failed`; any other missing name means the test
needs code newer than the tree (`incompatible`).
"""

from __future__ import annotations

import ast
import builtins
import keyword
import re
import textwrap
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePosixPath

from unidiff import PatchSet

# ---- what the pack adds ------------------------------------------------------------------------

_DEF_RE = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)")
_CLASS_RE = re.compile(r"^\s*class\s+(\w+)")
# `name = v`, `name: T = v`, `self.a.name = v` at any depth: module constants, class and
# instance attributes (a local variable too, which only ever widens the fix's names).
_ASSIGN_RE = re.compile(r"^\s*(?:\w+\.)*(\w+)\s*(?::[^=]+)?=(?!=)")
_SIGNATURE_LINES = 40  # a def whose signature runs longer is not read for parameters
_NOT_NAMES = frozenset(dir(builtins)) | {"self", "cls"}


def module_of(path: str) -> str | None:
    """`sglang/srt/x/__init__.py` -> `sglang.srt.x`; None for a file that is not Python."""
    target = PurePosixPath(path)
    if target.suffix != ".py":
        return None
    parts = list(target.with_suffix("").parts)
    if parts and parts[0] == "python":
        parts = parts[1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or None


def _added_parameters(lines: list[tuple[str, bool]]) -> set[str]:
    """Parameters written on added lines of a `def` signature (the hunk's new side)."""
    found: set[str] = set()
    for start, (text, _) in enumerate(lines):
        if not _DEF_RE.match(text):
            continue
        span: list[tuple[str, bool]] = []
        for text_, added in lines[start:start + _SIGNATURE_LINES]:
            span.append((text_, added))
            try:
                tree = ast.parse(textwrap.dedent("".join(t for t, _ in span)) + "\n    pass\n")
            except SyntaxError:
                continue
            node = tree.body[0]
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            added_words = {w for t, a in span if a for w in re.findall(r"\w+", t)}
            found.update(a.arg for a in every if a is not None and a.arg in added_words)
            break
    return found


def patch_added_names(patchset: PatchSet) -> set[str]:
    """Every name one patch adds: defs, classes, assigned names, parameters, new modules."""
    names: set[str] = set()
    for patched in patchset:
        if patched.is_added_file and (module := module_of(patched.path)):
            names.add(module)
        # A def or assignment the file also loses (a changed signature, a new value) is not new.
        added = _bound_names(line.value for hunk in patched for line in hunk if line.is_added)
        removed = _bound_names(line.value for hunk in patched for line in hunk if line.is_removed)
        names |= added - removed
        for hunk in patched:
            names |= _added_parameters([(line.value, line.is_added) for line in hunk if not line.is_removed])
    return {name for name in names if not keyword.iskeyword(name) and name not in _NOT_NAMES}


def _bound_names(lines) -> set[str]:
    found: set[str] = set()
    for text in lines:
        for pattern in (_DEF_RE, _CLASS_RE, _ASSIGN_RE):
            match = pattern.match(text)
            if match:
                found.add(match.group(1))
    return found


def fingerprint_names(pattern: str) -> set[str]:
    """The identifiers a fingerprint pattern spells out (regex syntax, keywords, builtins dropped)."""
    text = re.sub(r"\\[AbBdDsSwWZ]", " ", pattern)   # class shorthands, not letters
    text = re.sub(r"\[[^\]]*\]", " ", text)           # character sets
    text = re.sub(r"\(\?P?<?\w*>?|\(\?[:=!]", " ", text)  # group syntax
    text = re.sub(r"\\(.)", r"\1", text)              # escaped literals
    return {word for word in re.findall(r"[A-Za-z_]\w*", text)
            if not keyword.iskeyword(word) and word not in _NOT_NAMES}


def pack_added_names(pack) -> frozenset[str]:
    """Every name any patch variant of the pack adds."""
    names: set[str] = set()
    for variants in pack.variants.values():
        for variant in variants:
            if variant.patchset is not None:
                names |= patch_added_names(variant.patchset)
    return frozenset(names)


def pack_fix_names(pack) -> frozenset[str]:
    """A fix's names: every name any patch of the pack adds, and every present-rule fingerprint name.

    A rule with `absent = true` names what a fix removes, so its words are not fix names.
    """
    names = set(pack_added_names(pack))
    for fix in pack.fixes.values():
        for rule in fix.fingerprint:
            if not rule.absent:
                names |= fingerprint_names(rule.pattern)
    return frozenset(names)


# ---- what a tree has -------------------------------------------------------------------------


class TreeNames:
    """Answers "does this tree have that module / name at all?" from its source files."""

    def __init__(self, package_root: Path):
        self.root = Path(package_root)
        self._defs: dict[str, set[str] | None] = {}

    def module_file(self, dotted: str) -> Path | None:
        base = self.root.joinpath(*dotted.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def module_exists(self, dotted: str) -> bool:
        if self.module_file(dotted):
            return True
        base = self.root.joinpath(*dotted.split("."))
        return base.is_dir() or any(base.parent.glob(base.name + ".*.so"))

    def module_defines(self, dotted: str, name: str) -> bool | None:
        """True/False when the module's source says; None when it cannot tell (star imports etc.)."""
        if self.module_exists(f"{dotted}.{name}"):
            return True
        if dotted not in self._defs:
            self._defs[dotted] = top_level_names(self.module_file(dotted))
        names = self._defs[dotted]
        if names is None:
            return None
        return name in names

    @cached_property
    def _all_words(self) -> set[str]:
        words: set[str] = set()
        for path in (self.root / "sglang").rglob("*.py"):
            try:
                words.update(re.findall(r"[A-Za-z_]\w*", path.read_text(errors="replace")))
            except OSError:
                continue
        return words

    def word_anywhere(self, name: str) -> bool:
        return name in self._all_words


def top_level_names(path: Path | None) -> set[str] | None:
    """Names a module binds at top level; None when it cannot tell (star import, dynamic globals)."""
    if path is None:
        return None
    try:
        module = ast.parse(path.read_text(errors="replace"))
    except (SyntaxError, ValueError):
        return None
    names: set[str] = set()

    def bind(target: ast.AST) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.add(node.id)

    def visit(body: list[ast.stmt]) -> bool:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for alias in stmt.names:
                    if alias.name == "*":
                        return False
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    bind(target)
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                bind(stmt.target)
            elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)):
                if isinstance(stmt, (ast.For, ast.AsyncFor)):
                    bind(stmt.target)
                else:
                    for item in stmt.items:
                        if item.optional_vars is not None:
                            bind(item.optional_vars)
                if not visit(stmt.body) or not visit(getattr(stmt, "orelse", [])):
                    return False
            elif isinstance(stmt, ast.If):
                if not visit(stmt.body) or not visit(stmt.orelse):
                    return False
            elif isinstance(stmt, (ast.Try, ast.TryStar)):
                blocks = [stmt.body, stmt.orelse, stmt.finalbody] + [h.body for h in stmt.handlers]
                if not all(visit(block) for block in blocks):
                    return False
            elif (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                  and "globals" in ast.dump(stmt.value)):
                return False  # globals().update(...) and similar dynamic definitions: cannot tell
        return True

    if not visit(module.body) or "__getattr__" in names:
        return None
    return names


# ---- the name a failing test lacked --------------------------------------------------------------


@dataclass(frozen=True)
class Missing:
    name: str          # the qualified name the tree lacks
    leaf: str          # its last component, matched against the fix's names
    kind: str          # exception type

    def is_fix_name(self, fix_names: frozenset[str]) -> bool:
        return self.leaf in fix_names or self.name in fix_names


def missing_name(kind: str, message: str, names: TreeNames) -> Missing | None:
    """The sglang module or attribute named by an import/attribute error, when the tree lacks it."""
    message = message.strip()
    if "partially initialized module" in message or "circular import" in message:
        return None
    if kind == "ModuleNotFoundError" or (kind == "ImportError" and message.startswith("No module named")):
        match = re.search(r"No module named '([\w.]+)'", message)
        if match and match.group(1).split(".")[0] == "sglang" and match.group(1) != "sglang":
            dotted = match.group(1)
            if not names.module_exists(dotted):
                return Missing(dotted, dotted, kind)
        return None
    if kind == "ImportError":
        match = re.search(r"cannot import name '(\w+)' from '([\w.]+)'", message)
        if match and match.group(2).split(".")[0] == "sglang":
            name, module = match.groups()
            if names.module_defines(module, name) is False:
                return Missing(f"{module}.{name}", name, kind)
        return None
    if kind != "AttributeError":
        return None
    match = (re.search(r"^module '([\w.]+)' has no attribute '(\w+)'", message)
             or re.search(r"^<module '([\w.]+)'.*> does not have the attribute '(\w+)'", message))
    if match:
        module, name = match.groups()
        if module.split(".")[0] == "sglang" and names.module_defines(module, name) is False:
            return Missing(f"{module}.{name}", name, kind)
        return None
    match = (re.search(r"^<class '([\w.]+)'> does not have the attribute '(\w+)'", message)
             or re.search(r"^type object '(\w+)' has no attribute '(\w+)'", message)
             or re.search(r"^'(\w+)' object has no attribute '(\w+)'", message)
             or re.search(r"^(Mock) object has no attribute '(\w+)'", message))
    if match:
        owner, name = match.groups()
        if not names.word_anywhere(name):
            return Missing(f"{owner}.{name}", name, kind)
    return None


def static_missing_imports(source: str, names: TreeNames) -> list[Missing]:
    """Module-level `from sglang... import X` / `import sglang...` the tree cannot satisfy."""
    try:
        module = ast.parse(source)
    except SyntaxError:
        return []
    missing: list[Missing] = []
    for stmt in module.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module and (
                stmt.module == "sglang" or stmt.module.startswith("sglang.")):
            if not names.module_exists(stmt.module):
                missing.append(Missing(stmt.module, stmt.module, "ModuleNotFoundError"))
                continue
            for alias in stmt.names:
                if alias.name != "*" and names.module_defines(stmt.module, alias.name) is False:
                    missing.append(Missing(f"{stmt.module}.{alias.name}", alias.name, "ImportError"))
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.name.startswith("sglang.") and not names.module_exists(alias.name):
                    missing.append(Missing(alias.name, alias.name, "ModuleNotFoundError"))
    return missing
