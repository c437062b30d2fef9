"""jsonschema for the evidence checks, imported on first use and without the rfc3987 grammar.

Importing jsonschema imports `rfc3987_syntax` when it is installed (cyclonedx's validation extra
installs it), which compiles a Lark grammar of RFC 3987: about 1.7 s of CPU on this project's
machine, paid by every process that validates anything. jsonschema uses it only for the `iri`
and `iri-reference` formats. The receipt and OpenVEX schemas use neither; the CycloneDX 1.6
schema uses `iri-reference` for its URLs, which `iri_reference` below checks well enough (no
character RFC 3987 forbids outside a percent-escape, every `%` an escape, a valid scheme when
there is one). The same checks are installed whether or not the grammar was already loaded, so
the result never depends on which module imported jsonschema first.
"""

from __future__ import annotations

import re
import sys
from functools import cache
from types import ModuleType

GRAMMAR_MODULE = "rfc3987_syntax"
IRI_FORMATS = ("iri", "iri-reference")

# Characters RFC 3987 allows nowhere in an IRI (controls, space, and the RFC 3986 "unwise" set),
# and a `%` that does not start a percent-escape.
_FORBIDDEN = re.compile(r'[\x00-\x20\x7f-\x9f<>"{}|\\^`]|%(?![0-9A-Fa-f]{2})')
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def iri_reference(value: object) -> bool:
    """An IRI or a relative reference (non-strings are another keyword's business, as in jsonschema)."""
    if not isinstance(value, str):
        return True
    return _FORBIDDEN.search(value) is None


def iri(value: object) -> bool:
    """An absolute IRI: a reference that starts with a scheme."""
    if not isinstance(value, str):
        return True
    return iri_reference(value) and _SCHEME.match(value) is not None


@cache
def load() -> ModuleType:
    """The jsonschema module, its drafts' format checkers using the IRI checks above."""
    blocked = GRAMMAR_MODULE not in sys.modules
    if blocked:
        # A None entry makes `import rfc3987_syntax` raise ImportError, which jsonschema expects
        # (the package is optional to it); removed again so that nothing else is affected.
        sys.modules[GRAMMAR_MODULE] = None  # type: ignore[assignment]
    try:
        import jsonschema
    finally:
        if blocked:
            del sys.modules[GRAMMAR_MODULE]
    for validator in (jsonschema.Draft7Validator, jsonschema.Draft201909Validator,
                      jsonschema.Draft202012Validator):
        checker = validator.FORMAT_CHECKER
        checker.checks("iri")(iri)
        checker.checks("iri-reference")(iri_reference)
    return jsonschema
