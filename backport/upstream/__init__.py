"""Upstream SGLang's own CPU unit tests, run against trees as differential evidence.

The tests the SGLang maintainers wrote for a fix live in the repository's `test/` tree,
which no wheel ships and this project never commits. The pack names them per fix
(`refs`); they are obtained at run time from an upstream checkout, the cache or a raw-file
server (`fetch`), run with pytest one process per file and tree (`run`), and each result
is read from pytest's JUnit XML (`junit`), a failure on a name the tree lacks judged by
whose name it is (`names`).
"""

from backport.upstream.fetch import (
    BASE_URL_ENV,
    DEFAULT_BASE_URL,
    Fetched,
    Fetcher,
    fetch_refs,
    measure_pins,
    resolve_base_url,
)
from backport.upstream.junit import OUTCOMES
from backport.upstream.refs import (
    DEFAULT_SERIES,
    TestRef,
    ad_hoc_refs,
    check_ref,
    load_refs,
    series_added_names,
    with_rev,
)
from backport.upstream.run import run_upstream_tests

__all__ = [
    "BASE_URL_ENV",
    "DEFAULT_BASE_URL",
    "DEFAULT_SERIES",
    "OUTCOMES",
    "Fetched",
    "Fetcher",
    "TestRef",
    "ad_hoc_refs",
    "check_ref",
    "fetch_refs",
    "load_refs",
    "measure_pins",
    "resolve_base_url",
    "run_upstream_tests",
    "series_added_names",
    "with_rev",
]
