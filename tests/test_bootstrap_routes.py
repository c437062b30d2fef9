"""The pack's own fix `sbp-bootstrap-auth` (sgl-project/sglang#39400, design #39416): its pack facts,
its class and advisory row, and on real releases that it alone turns route poisoning safe with the
registrant's own calls and decode's reads still working; the token is resolved in #39416's order
and never reaches a log line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backport import advisories
from backport.engine import apply_series
from backport.evidence.vulnerabilities import add_aliases, class_status, load_classes
from backport.pack import load_pack
from backport.releases import load_pins
from backport.tree import clone_tree

REPO = Path(__file__).resolve().parent.parent
FIX = "sbp-bootstrap-auth"
CLASS = "SBP-2026-0005"
SERVED = ("0.4.5.post1", "0.4.5.post2", "0.4.5.post3", "0.4.6", "0.4.6.post1", "0.4.6.post2",
          "0.4.6.post3", "0.4.6.post4", "0.4.6.post5", "0.4.7", "0.4.7.post1", "0.4.8", "0.4.8.post1",
          "0.4.9", "0.4.9.post1", "0.4.9.post2",
          "0.4.9.post3", "0.4.9.post4", "0.4.9.post5", "0.4.9.post6", "0.4.10", "0.4.10.post1",
          "0.4.10.post2", "0.5.1", "0.5.1.post1", "0.5.1.post2", "0.5.1.post3", "0.5.2",
          "0.5.3", "0.5.3.post1", "0.5.3.post2", "0.5.3.post3", "0.5.4", "0.5.4.post1", "0.5.4.post2",
          "0.5.4.post3", "0.5.5", "0.5.5.post1", "0.5.5.post2", "0.5.5.post3", "0.5.6", "0.5.6.post1",
          "0.5.6.post2", "0.5.7",
          "0.5.8", "0.5.8.post1", "0.5.9", "0.5.10", "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1",
          "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18",
          "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
# -0.5.22 serves 0.5.22 - 0.5.23, -0.5.19 0.5.19 - 0.5.21, -0.5.17 0.5.17 - 0.5.18 (offsets only);
# -0.5.16 serves 0.5.16, -0.5.15 0.5.13 - 0.5.15.post1,
# -0.5.12.post1 serves 0.5.12 too, -0.5.11 0.5.10 - 0.5.10.post1, -0.5.9 0.5.5.post3 - 0.5.8.post1,
# -0.5.5.post2 0.5.4.post3 - 0.5.5.post1, -0.5.4.post1 0.5.3 - 0.5.4, -0.5.2 0.5.1 - 0.5.2;
# -0.4.10.post2 serves 0.4.10.post2, -0.4.10.post1 0.4.9.post2 - 0.4.10.post1, -0.4.9.post1
# 0.4.8 - 0.4.9.post1, -0.4.7.post1 and -0.4.7 their own release; -0.4.6.post5 serves 0.4.6.post3 -
# 0.4.6.post5, -0.4.6.post2 0.4.6 - 0.4.6.post2, -0.4.5.post3 0.4.5.post3 alone (NIXL's own server first
# appears), -0.4.5.post2 0.4.5.post1 - 0.4.5.post2 (offsets only)
VARIANTS = ("0.4.5.post2", "0.4.5.post3", "0.4.6.post2", "0.4.6.post5",
            "0.4.7", "0.4.7.post1", "0.4.9.post1", "0.4.10.post1", "0.4.10.post2", "0.5.2",
            "0.5.4.post1", "0.5.4.post2", "0.5.5.post2", "0.5.9", "0.5.11", "0.5.12.post1",
            "0.5.15", "0.5.16", "0.5.17", "0.5.19", "0.5.22")
CASES = {"unauthenticated_route_update_refused": False, "authenticated_registration_accepted": True,
         "decode_rendezvous_reads_open": True}


@pytest.fixture(scope="module")
def pack():
    return load_pack(REPO / "patches")


def test_vendor_fix_after_every_other_fix_scoped_to_the_served_releases(pack):
    fix = pack.fixes[FIX]
    assert pack.series[-1] == FIX
    assert fix.is_vendor and fix.url.endswith("/pull/39416") and fix.bug.endswith("/issues/39400")
    pins = load_pins()
    assert not any(fix.is_fixed_in(v) for v in pins)  # no release authenticates the bootstrap server
    assert [v for v in pins if fix.in_scope(v)] == list(SERVED)
    assert sorted(v.name for v in pack.variants[FIX]) == sorted(f"{FIX}-{v}.patch" for v in VARIANTS)


def test_class_and_advisory_name_the_fix(pack):
    classes = {c.id: c for c in load_classes(REPO / "patches", list(pack.fixes))}
    row = classes[CLASS]
    assert row.fixes == (FIX,) and row.probes == ("bootstrap_routes",)
    assert {"https://github.com/sgl-project/sglang/issues/39400",
            "https://github.com/sgl-project/sglang/pull/39416"} <= set(row.references)
    adv = next(a for a in advisories.load_for(pack) if a.id == "sgl-project/sglang#39400")
    assert adv.pack_class == CLASS
    # `run --vuln-alias` names the class by id or by name, as for the others
    aliases = {CLASS: ["CVE-2026-99999"], row.name: ["GHSA-c3g4-8h2j-mpqr"]}
    more = add_aliases(list(classes.values()), aliases)
    assert next(c for c in more if c.id == CLASS).aliases == ("CVE-2026-99999", "GHSA-c3g4-8h2j-mpqr")


def test_the_class_is_fixed_only_where_the_refusal_ran_fixed(pack):
    """A release outside the served range keeps the refusal case unsafe on its head: affected,
    never not_affected (the class names no `introduced_with`: every release has the route)."""
    row = next(c for c in load_classes(REPO / "patches", list(pack.fixes)) if c.id == CLASS)

    def rows(patched_refusal: str) -> list[dict]:
        return [
            {
                "probe": "bootstrap_routes",
                "case": n,
                "must_preserve": m,
                "verdicts": {
                    "pristine": "safe" if m else "unsafe",
                    "patched": "safe" if m else patched_refusal,
                },
                "pair": "held" if m else ("fixed" if patched_refusal == "safe" else "still-unsafe"),
            }
            for n, m in CASES.items()
        ]

    assert class_status(row, rows("safe")).status == "fixed"
    assert class_status(row, rows("unsafe")).status == "affected"


def test_probe_module_registers_its_cases_with_the_standard_library_only():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import sys; from probes import PROBE_NAMES, cases_of; "
                "assert 'bootstrap_routes' in PROBE_NAMES; "
                "print(*[f'{c.name}={c.must_preserve}' for c in cases_of('bootstrap_routes')]); "
                "assert 'torch' not in sys.modules and 'sglang' not in sys.modules"
            ),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert dict(x.split("=") for x in out) == {k: str(v) for k, v in CASES.items()}


# ---------------------------------------------------------------------------
# real releases


def _verdicts(doc: dict) -> dict[str, str]:
    assert "error" not in doc, doc.get("error")
    return {c["case"]: c["verdict"] for c in doc["cases"]}


def _only_the_fix(release_tree, tmp_path, pack, version: str):
    tree = clone_tree(release_tree(version), tmp_path, tmp_path / "only")
    report = apply_series(tree.path, pack, version, only=[FIX])
    assert [(p.fix, p.status) for p in report.patches] == [(FIX, "applied")]
    return tree


@pytest.mark.probe_env
@pytest.mark.network
@pytest.mark.parametrize("version", ["0.5.19", "0.5.22"])
def test_the_fix_alone_refuses_route_poisoning(version, release_tree, probe_python, tmp_path, pack):
    from backport.probing import run_harness

    pristine = release_tree(version)
    tree = _only_the_fix(release_tree, tmp_path, pack, version)
    before = _verdicts(run_harness(probe_python, pristine.path, probes=["bootstrap_routes"], version=version))
    after_doc = run_harness(probe_python, tree.path, probes=["bootstrap_routes"], version=version)
    after = _verdicts(after_doc)
    assert before == {**{k: "safe" for k in CASES}, "unauthenticated_route_update_refused": "unsafe"}
    assert after == {k: "safe" for k in CASES}
    by_case = {c["case"]: c for c in after_doc["cases"]}
    refused = by_case["unauthenticated_route_update_refused"]["details"]
    assert refused["put without a token"]["status"] == 401
    assert refused["put with a wrong token"]["status"] == 403
    assert refused["register_dp_rank without a token"]["status"] == 401
    accepted = by_case["authenticated_registration_accepted"]["details"]
    assert accepted["token_resolved"] and accepted["multi_node_without_token"] == "refused"

    # the advisory row reads the trees' code: fixed by the pack on the patched tree, open on the pristine
    rows = {role: advisories.tree_rows(advisories.load_for(pack), role, root, version,
                                       advisories.class_fixed(pack, root))
            for role, root in (("pristine", pristine.path), ("patched", tree.path))}
    status = {role: next(r.status for r in found if r.advisory == "sgl-project/sglang#39400")
              for role, found in rows.items()}
    assert status["patched"] == "fixed-by-pack"
    assert status["pristine"] not in ("fixed-by-pack", "not-applicable")


@pytest.mark.probe_env
@pytest.mark.network
@pytest.mark.parametrize("version", ["0.4.6.post5", "0.4.7"])
def test_the_probe_drives_nixls_bootstrap_server_where_not_mooncakes(version, release_tree, probe_python):
    """NIXL's bootstrap server and registrant are not the handlers Mooncake's cases drive on
    0.4.5.post3 - 0.4.6.post5 (NIXL's own) and on 0.4.7 - 0.5.2 (the common ones; Mooncake keeps
    its own): on the pristine release the attacker's PUT /route rewrites NIXL's table too, and
    NIXL's registrant (on 0.4.7 through the common constructor) registers rank 0 there."""
    from backport.probing import run_harness

    doc = run_harness(probe_python, release_tree(version).path, probes=["bootstrap_routes"], version=version)
    assert _verdicts(doc) == {**{k: "safe" for k in CASES}, "unauthenticated_route_update_refused": "unsafe"}
    by_case = {c["case"]: c["details"] for c in doc["cases"]}
    for label in ("without a token", "with a wrong token", "to a server without a token configured"):
        assert by_case["unauthenticated_route_update_refused"][f"NIXL's put {label}"] == {
            "status": 200, "route_after": ["203.0.113.66", 6666]}
    assert by_case["authenticated_registration_accepted"]["NIXL's route"] == ["10.0.0.1", 17000]


TOKEN_SCRIPT = r"""
import io, json, logging, os, sys
from types import SimpleNamespace
log = io.StringIO()
logging.basicConfig(level=logging.DEBUG, stream=log)
from sglang.srt.disaggregation.common import conn
ENV = conn.BOOTSTRAP_AUTH_TOKEN_ENV
args = lambda **kw: SimpleNamespace(**{"disaggregation_mode": "prefill", "nnodes": 1, "api_key": None, **kw})
out = {}
os.environ.pop(ENV, None)
out["api_key"] = conn.resolve_bootstrap_auth_token(args(api_key="from-api-key"))
os.environ[ENV] = "from-env"
out["env_over_api_key"] = conn.resolve_bootstrap_auth_token(args(api_key="from-api-key"))
os.environ.pop(ENV, None)
conn.ensure_bootstrap_auth_token(args(api_key="from-api-key"))
out["parent_exports_api_key"] = os.environ[ENV]
os.environ.pop(ENV, None)
conn.ensure_bootstrap_auth_token(args())
generated = os.environ[ENV]
out["generated_length"] = len(generated)
os.environ.pop(ENV, None)
try:
    conn.ensure_bootstrap_auth_token(args(nnodes=2))
    out["multi_node"] = "started"
except ValueError as err:
    out["multi_node"] = str(err)
os.environ[ENV] = generated
out["headers"] = conn.bootstrap_auth_headers(args()) == {"Authorization": "Bearer " + generated}
out["refusals"] = [conn.bootstrap_auth_refusal(h, generated) for h in
                   (None, "Basic " + generated, "Bearer wrong", "Bearer " + generated, "bearer " + generated)]
out["refusal_without_server_token"] = conn.bootstrap_auth_refusal("Bearer " + generated, None)
out["token_in_log"] = generated in log.getvalue() or "from-api-key" in log.getvalue()
out["logged"] = "Generated a bootstrap auth token" in log.getvalue()
print(json.dumps(out))
"""


@pytest.mark.probe_env
@pytest.mark.network
def test_token_sources_in_order_and_never_logged(release_tree, probe_python, tmp_path, pack):
    """#39416's order: the environment, else --api-key, else a generated secret the engine parent
    exports for its children; two prefill nodes without a shared token refuse to start."""
    from backport.probing.harness import probe_environ

    tree = _only_the_fix(release_tree, tmp_path, pack, "0.5.19")
    done = subprocess.run(
        [probe_python, "-c", TOKEN_SCRIPT],
        env=probe_environ(probe_python, tree.path, REPO),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["api_key"] == "from-api-key" and out["env_over_api_key"] == "from-env"
    assert out["parent_exports_api_key"] == "from-api-key"
    assert out["generated_length"] >= 32
    assert "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN" in out["multi_node"]
    assert "every prefill node" in out["multi_node"]
    assert out["headers"] and out["refusals"] == [401, 401, 403, None, None]
    assert out["refusal_without_server_token"] == 403
    assert out["logged"] and not out["token_in_log"]
