"""Normalising a run's raw documents so that a bundle's files depend on the inputs only.

Absolute paths of temporary trees, clones and caches differ from run to run. Before a
document is hashed, every such path is replaced by a stable name (a tree's package root by
its role, a directory by ``""`` to make its paths relative); volatile numbers move out
(``import_seconds`` goes to the receipt's ``timestamps``).

This module knows no path by itself except the toolkit's own ``probes`` package: the caller
names every other path to replace (see ``RunRecord.extra_paths``, record.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, overload

from backport import resources

Replacements = Iterable[tuple[str | Path | None, str]]


def _toolkit_paths() -> list[tuple[Path, str]]:
    return [(resources.probes_dir(), "probes")]


class Scrubber:
    """Replace absolute paths in every string of a JSON value (longest path first).

    Each (path, name) pair replaces the path and its resolved form by `name`; an empty
    name makes paths under it relative (the directory and its separator are dropped).
    """

    def __init__(self, replacements: Replacements):
        pairs: dict[str, str] = {}
        for path, name in replacements:
            if path is None:
                continue
            for variant in {str(path), os.path.realpath(str(path))}:
                variant = variant.rstrip("/")
                if len(variant) > 1:
                    pairs.setdefault(variant, name)
        self.pairs = sorted(pairs.items(), key=lambda item: -len(item[0]))

    def text(self, value: str) -> str:
        for path, name in self.pairs:
            if path in value:
                if name:
                    value = value.replace(path, name)
                else:
                    value = value.replace(path + "/", "").replace(path, ".")
        return value

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, dict):
            return {self.text(k) if isinstance(k, str) else k: self(v) for k, v in value.items()}
        return value


def normalise_probe(document: dict, role: str, package_root: Path | str,
                    extra: Replacements = ()) -> tuple[dict, dict]:
    """(normalised harness document, volatile values moved out of it)."""
    package_root = Path(package_root)
    scrub = Scrubber([(package_root, role), *extra, *_toolkit_paths()])
    doc = dict(document)
    volatile: dict[str, Any] = {}
    if "import_seconds" in doc:
        volatile["import_seconds"] = doc.pop("import_seconds")
    doc["tree"] = role
    sglang_file = doc.get("sglang_file")
    if isinstance(sglang_file, str) and os.path.isabs(sglang_file):
        for root in (str(package_root), os.path.realpath(str(package_root))):
            if os.path.commonpath([sglang_file, root]) == root:
                doc["sglang_file"] = Path(os.path.relpath(sglang_file, root)).as_posix()
                break
    return scrub(doc), volatile


@overload
def normalise_document(document: dict, replacements: Replacements) -> dict: ...
@overload
def normalise_document(document: None, replacements: Replacements) -> None: ...
@overload
def normalise_document(document: dict | None, replacements: Replacements) -> dict | None: ...


def normalise_document(document: dict | None, replacements: Replacements) -> dict | None:
    if document is None:
        return None
    return Scrubber([*replacements, *_toolkit_paths()])(document)
