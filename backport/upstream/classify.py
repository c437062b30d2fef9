"""What a failing upstream test says about the tree: a missing fix, newer code, or a stale test.

In order:

1. The test stopped on a name the tree lacks (see `names`). A fix's name makes it `failed`:
   the tree lacks the fix, whatever else it lacks. Only other names: `incompatible`.
2. `stale-test`: the failure is in the test's own stand-ins (a stand-in that does not take
   the call this release's code makes, or lacks an attribute the release's code reads; a
   `types.SimpleNamespace` double the test builds included, see `doubles`) or
   in a signature the release predates (the test itself calls the tree with a keyword or
   arity it does not have, the keyword not one a fix adds). The reason carries the
   evidence: the call, and where it was made. The tree calling its own code wrongly is
   never stale.
3. Otherwise pytest's outcome stands (`failed` or `error`): behaviour.

A stand-in raising on purpose (a simulated transfer failure) is never stale: only call
signatures and missing attributes are judged, so a real regression stays `failed`.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from backport.upstream.doubles import bare_instances, namespace_double
from backport.upstream.names import Missing, TreeNames, missing_name
from backport.vocab import TestOutcome

REASON_LIMIT = 400

_EXC_LINE_RE = re.compile(
    r"^(?:E\s+)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)): (.*)$"
)
_NAME_ERRORS = ("ImportError", "ModuleNotFoundError", "AttributeError")
_LOCATION_RE = re.compile(r"^(\S+\.py):(\d+): ?\w*$")
_UNITTEST_HOOKS = ("setUp", "tearDown", "setUpClass", "tearDownClass", "setUpModule", "tearDownModule",
                   "asyncSetUp", "asyncTearDown")
_SIGNATURE_RES = (
    re.compile(r"^([\w.<>]+)\(\) got an unexpected keyword argument '(\w+)'"),
    re.compile(r"^([\w.<>]+)\(\) got multiple values for argument '(\w+)'"),
    re.compile(r"^([\w.<>]+)\(\) takes .* positional arguments? but .* (?:was|were) given"),
    re.compile(r"^([\w.<>]+)\(\) missing \d+ required (?:positional|keyword-only) arguments?: (.*)"),
)
_STANDIN_ATTRIBUTE_RES = (re.compile(r"^'(?:[\w]+\.)*(\w+)' object has no attribute '(\w+)'"),
                          re.compile(r"^type object '(?:[\w]+\.)*(\w+)' has no attribute '(\w+)'"))
_MOCK_NOT_CALLED_RE = re.compile(r"Expected '(\w+)' to (?:be|have been) called")


def scrub(text: str, tmp: str, tree: Path | None = None) -> str:
    """One line, without temp paths, tree paths or object addresses (receipts compare reasons)."""
    text = text.replace(tmp, "<tmp>")
    if tree is not None:
        text = text.replace(str(tree), "<tree>")
    text = re.sub(r"0x[0-9a-fA-F]{6,}", "0x…", text)
    text = re.sub(r"id='\d+'", "id='…'", text)
    text = " ".join(text.split())
    return text if len(text) <= REASON_LIMIT else text[: REASON_LIMIT - 1] + "…"


def last_exception(message: str, text: str) -> tuple[str, str] | None:
    """(type, message) of the exception that ended the test, from JUnit's message and body."""

    def last(source: str) -> tuple[str, str] | None:
        found = None
        for line in (source or "").splitlines():
            match = _EXC_LINE_RE.match(line.strip())
            if match:
                found = (match.group(1).rsplit(".", 1)[-1], match.group(2).strip())
        return found

    from_message = last(message)
    if from_message and from_message[0] in _NAME_ERRORS:
        return from_message
    # A setup failure's message wraps the exception; the body shows the one that was raised.
    return last(text) or from_message


def stand_ins(source: str) -> frozenset[str]:
    """Classes and helper functions the test file defines: everything but its tests and hooks."""
    try:
        module = ast.parse(source)
    except SyntaxError:
        return frozenset()
    found: set[str] = set()
    for node in ast.walk(module):
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases}
            if not node.name.startswith("Test") and not any(b.endswith("TestCase") for b in bases):
                found.add(node.name)
        elif (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
              and not node.name.startswith("test") and node.name not in _UNITTEST_HOOKS):
            found.add(node.name)
    return frozenset(found)


def crash_site(body: str, tree: Path, tmp: str) -> str | None:
    """Where the exception surfaced, as `sglang/...py:N` in the tree or `test_x.py:N` in the test."""
    site = None
    for line in body.splitlines():
        match = _LOCATION_RE.match(line.strip())
        if match:
            site = match.groups()
    if site is None:
        return None
    path, lineno = site
    # pytest prints paths relative to its rootdir, the temporary directory the test ran in.
    where = Path(os.path.normpath(Path(tmp) / path))
    for base in (Path(tree).resolve(), Path(tmp)):
        if where.is_relative_to(base):
            return f"{where.relative_to(base).as_posix()}:{lineno}"
    return f"{path}:{lineno}"


def _mock_never_called(kind: str, text: str, names: TreeNames) -> Missing | None:
    """A mock the tree was expected to call, named for code the tree has nowhere."""
    match = _MOCK_NOT_CALLED_RE.search(text) if kind == "AssertionError" else None
    if match and match.group(1) != "mock" and not names.word_anywhere(match.group(1)):
        return Missing(match.group(1), match.group(1), kind)
    return None


def _stale(kind: str, text: str, *, site: str | None, names: TreeNames, fix_names: frozenset[str],
           standins: frozenset[str], source: str = "", has_fix: bool | None = None,
           own_names: frozenset[str] = frozenset()) -> tuple[TestOutcome, str] | None:
    """(outcome, evidence) for a signature or stand-in failure; None for anything else."""
    in_tree = bool(site and site.startswith("sglang/"))
    at = f" at {site}" if site else ""
    if kind == "TypeError":
        for pattern in _SIGNATURE_RES:
            match = pattern.match(text)
            if not match:
                continue
            callee = match.group(1)
            parts = [p for p in callee.split(".") if p != "<locals>"]
            owner = parts[-2] if len(parts) > 1 else parts[-1]
            if owner in standins and (in_tree or not names.word_anywhere(owner)):
                return TestOutcome.STALE_TEST, f"the test's stand-in {callee} does not take the call made{at}"
            if in_tree or not site or not names.word_anywhere(parts[-1]):
                # The tree calling its own code wrongly is a real failure; a callee neither the
                # test's nor the tree's is not judged here.
                return None
            keyword = match.group(2) if "keyword argument" in pattern.pattern else None
            if keyword and keyword in fix_names:
                return (TestOutcome.FAILED,
                        f"the tree's {callee} has no keyword {keyword}, which the fixes add")
            return (TestOutcome.STALE_TEST,
                    f"the test calls {callee} with a signature this release does not have{at}")
        return None
    if kind == "AttributeError":
        for pattern in _STANDIN_ATTRIBUTE_RES:
            match = pattern.match(text)
            # Only when the tree's code read it: a test reading its own stand-in for something the
            # tree should have set there is a behaviour failure.
            if match and match.group(1) in standins and in_tree:
                owner, name = match.groups()
                return (
                    TestOutcome.STALE_TEST,
                    f"the test's stand-in {owner} has no {name}, which this release reads{at}",
                )
            # The test's hand-made doubles, judged only where the tree has the file's fix: on a tree
            # without it, the release's other path reaching past a double is the missing fix.
            if not (match and in_tree) or has_fix is False:
                continue
            owner, name = match.groups()
            if owner == "SimpleNamespace":
                double = namespace_double(source, names.root, site)
                described = double.describe() if double else None
            else:
                described = (f"bare {owner} (built with {owner}.__new__, attributes set by hand)"
                             if owner in bare_instances(source) else None)
            if described and name in own_names:
                return TestOutcome.STALE_TEST, (
                    f"the test's double {described} has no {name}, which only this pack's "
                    f"own fix adds (no upstream release has it){at}")
            if described and name not in fix_names:
                return (
                    TestOutcome.STALE_TEST,
                    f"the test's double {described} has no {name}, which this release reads{at}",
                )
    return None


def classify(outcome: TestOutcome, message: str, body: str, *, names: TreeNames, fix_names: frozenset[str],
             static: list[Missing] | None, tmp: str, standins: frozenset[str] = frozenset(),
             source: str = "", has_fix: bool | None = None,
             own_names: frozenset[str] = frozenset()) -> tuple[TestOutcome, str]:
    """Final (outcome, reason) for a failed or errored test case."""
    tree = names.root
    found = last_exception(message, body)
    dynamic = None
    if found and found[0] in _NAME_ERRORS:
        dynamic = missing_name(*found, names)
    elif found:
        dynamic = _mock_never_called(found[0], f"{found[1]}\n{message}", names)
    line = f"{found[0]}: {found[1]}" if found else (message or body.strip().splitlines()[-1:] or [""])[0]
    candidates = list(static or [])
    if dynamic and all(m.name != dynamic.name for m in candidates):
        candidates.insert(0, dynamic)
    related = [m for m in candidates if m.is_fix_name(fix_names)]
    unrelated = [m for m in candidates if not m.is_fix_name(fix_names)]
    if related:  # the fix is missing, whatever newer code the test also needs
        listed = ", ".join(m.name for m in related)
        extra = (f"; it also lacks {', '.join(m.name for m in unrelated)} (code newer than the tree)"
                 if unrelated else "")
        return TestOutcome.FAILED, scrub(f"the tree lacks {listed}, which the fixes add{extra} ({line})", tmp,
                                         tree)
    if unrelated:
        listed = ", ".join(m.name for m in unrelated)
        return TestOutcome.INCOMPATIBLE, scrub(
            f"the tree has no {listed}: the test needs code this tree does not have ({line})", tmp, tree)
    if found:
        judged = _stale(found[0], found[1], site=crash_site(body, tree, tmp), names=names,
                        fix_names=fix_names, standins=standins, source=source, has_fix=has_fix,
                        own_names=own_names)
        if judged:
            return judged[0], scrub(f"{judged[1]} ({line})", tmp, tree)
    return outcome, scrub(line, tmp, tree)
