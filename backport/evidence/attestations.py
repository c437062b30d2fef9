"""Standard attestations beside the receipt: in-toto Statements v1 with predicate types that
policy engines select, each signed into a DSSE envelope by `sign` (sign.py).

Statements (all rebuilt by `verify --key` from the receipt, standards.json and the bundle's
files, and compared with what the envelopes carry):

- SLSA Provenance v1 for the exported wheel: resolvedDependencies are the pinned upstream wheel
  and every patch file the engine applied, by digest; the builder is the toolkit (version and
  commit);
- in-toto Test Result v0.1 per probed tree: the probe cases as test names (safe -> passed,
  not-applicable -> warned, unsafe or error -> failed), the tree's probe document as the
  configuration;
- the OpenVEX document as a predicate, about the same products as its statements.

Tree subjects are named `<role>-tree/sglang` and carry two standard digests: `dirHash1`
(in-toto's directory hash, the receipt's tree digest: docs/vex-and-ci.md, "Tree digests") and `gitTree`
(the git tree id of `sglang/` at the tree's commit, when the tree was a git tree).
"""

from __future__ import annotations

import json

from backport import gitops
from backport.evidence.layout import probe_file, product_role, sha256_bytes
from backport.evidence.verdicts import ROLES
from backport.vocab import PatchStatus, TreeVerdict

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
TEST_RESULT = "https://in-toto.io/attestation/test-result/v0.1"
OPENVEX = "https://openvex.dev/ns/v0.2.0"
BUILD_TYPE = "https://sglang-backport.dev/build/export-wheel/v1"
BUILDER = "https://sglang-backport.dev/builder/sglang-backport"
RECEIPT_LINES = "receipt.intoto.jsonl"
_TEST_STATE = {TreeVerdict.SAFE: "passedTests", TreeVerdict.NOT_APPLICABLE: "warnedTests"}


def git_tree(tree) -> str | None:
    """The git tree id of a probed tree's `sglang/` at its recorded commit (None: not a git tree)."""
    if tree.tree_path is None or tree.package_root is None or not tree.commit:
        return None
    try:
        rel = tree.package_root.relative_to(tree.tree_path).as_posix()
    except ValueError:
        return None
    path = "sglang" if rel in ("", ".") else f"{rel}/sglang"
    try:
        return gitops.run(tree.tree_path, "rev-parse", f"{tree.commit}:{path}").decode().strip() or None
    except (gitops.GitError, OSError):
        return None


def git_trees(trees: dict) -> dict[str, str | None]:
    return {role: git_tree(tree) for role, tree in trees.items()}


def wheel_lines_name(statement: dict) -> str | None:
    """`<wheel>.intoto.jsonl` beside the exported wheel (None: nothing exported)."""
    wheel = (statement["predicate"].get("export") or {}).get("wheel")
    return f"{wheel['file']}.intoto.jsonl" if wheel else None


def tree_subject(statement: dict, standards: dict, role: str) -> dict:
    tree = statement["predicate"]["inputs"]["trees"][role]
    digest = {"dirHash1": tree["tree_digest"]}
    if standards.get("git_trees", {}).get(role):
        digest["gitTree"] = standards["git_trees"][role]
    return {"name": f"{role}-tree/sglang", "digest": digest,
            "annotations": {"version": tree["version"], "spec": tree["spec"]}}


def _statement(subjects: list[dict], predicate_type: str, predicate: dict) -> dict:
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": predicate_type,
        "predicate": predicate,
    }


def provenance(statement: dict) -> dict | None:
    """SLSA Provenance v1 of the exported wheel (None: nothing exported)."""
    p = statement["predicate"]
    export = p.get("export") or {}
    wheel = export.get("wheel")
    if not wheel:
        return None
    pristine = p["inputs"]["trees"]["pristine"]
    dependencies = [
        {
            "uri": f"pkg:pypi/sglang@{pristine['version']}",
            "name": wheel.get("original") or pristine["spec"],
            "digest": {"sha256": pristine["artifact_sha256"]},
        }
    ]
    dependencies += [{"name": f"patches/{item['path']}", "digest": {"sha256": item["sha256"]},
                      "annotations": {"fix": item["fix"]}}
                     for item in p["inputs"]["patches"] if item.get("status") == PatchStatus.APPLIED]
    toolkit = p["toolkit"]
    builder_version = {"sglang-backport": str(toolkit.get("version"))}
    if toolkit.get("git_commit"):
        builder_version["git_commit"] = toolkit["git_commit"]
    timestamps = p["timestamps"]
    predicate = {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": {"spec": p["inputs"]["target"]["spec"], "export": True},
            "internalParameters": {"label": export["label"], "patch_set_sha256": export["patch_set_sha256"]},
            "resolvedDependencies": dependencies,
        },
        "runDetails": {
            "builder": {"id": BUILDER, "version": builder_version},
            "metadata": {"startedOn": timestamps["started"], "finishedOn": timestamps["finished"]},
        },
    }
    subject = {"name": wheel["file"].rsplit("/", 1)[-1], "digest": {"sha256": wheel["sha256"]}}
    return _statement([subject], SLSA_PROVENANCE, predicate)


def test_results(statement: dict, standards: dict) -> list[dict]:
    """One Test Result v0.1 per probed tree, in role order."""
    p = statement["predicate"]
    found = []
    for role in [r for r in ROLES if probe_file(r) in p["files"]]:
        tests: dict[str, list[str]] = {"passedTests": [], "warnedTests": [], "failedTests": []}
        for row in p["cases"]:
            verdict = row["verdicts"].get(role)
            tests[_TEST_STATE.get(verdict, "failedTests")].append(f"{row['probe']}/{row['case']}")
        result = "FAILED" if tests["failedTests"] else "WARNED" if tests["warnedTests"] else "PASSED"
        file = probe_file(role)  # the configuration: the probe file, by its digest in predicate.files
        predicate = {"result": result, **tests,
                     "configuration": [{"name": file, "digest": {"sha256": p["files"][file]}}]}
        found.append(_statement([tree_subject(statement, standards, role)], TEST_RESULT, predicate))
    return found


def vex_statement(statement: dict, standards: dict, vex_document: dict) -> dict:
    """The OpenVEX document as the predicate, about its products: the wheel and the patched tree."""
    subjects = []
    wheel = (statement["predicate"].get("export") or {}).get("wheel")
    if wheel:
        subjects.append({"name": wheel["file"].rsplit("/", 1)[-1], "digest": {"sha256": wheel["sha256"]}})
    subjects.append(
        tree_subject(statement, standards, product_role(statement["predicate"]["inputs"]["trees"]))
    )
    return _statement(subjects, OPENVEX, vex_document)


def wheel_statements(statement: dict, standards: dict, vex_document: dict) -> list[dict]:
    """Everything `<wheel>.intoto.jsonl` carries, in line order ([] when nothing was exported)."""
    slsa = provenance(statement)
    if slsa is None:
        return []
    return [slsa, *test_results(statement, standards), vex_statement(statement, standards, vex_document)]


def model_problems(document: dict) -> list[str]:
    """What in-toto-attestation's models say of one statement: the Statement v1 rules (subjects
    with digests, a predicate type and object) and, for SLSA provenance and test results, that
    the predicate parses as its message."""
    from google.protobuf import json_format
    from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
    from in_toto_attestation.predicates.test_result.v0 import test_result_pb2
    from in_toto_attestation.v1 import statement_pb2
    from in_toto_attestation.v1.statement import Statement

    problems = []
    try:
        pb = statement_pb2.Statement()
        json_format.ParseDict(document, pb)
        Statement.copy_from_pb(pb).validate()
    except (json_format.ParseError, ValueError) as exc:
        problems.append(f"not an in-toto Statement v1: {exc}")
    predicate_type = document.get("predicateType")
    messages = {SLSA_PROVENANCE: provenance_pb2.Provenance, TEST_RESULT: test_result_pb2.TestResult}
    message = messages.get(predicate_type) if isinstance(predicate_type, str) else None
    if message is not None:
        try:
            json_format.ParseDict(document.get("predicate"), message())
        except json_format.ParseError as exc:
            problems.append(f"predicate is not a {document['predicateType']} predicate: {exc}")
    return problems


def payload_bytes(document: dict) -> bytes:
    """A statement's bytes inside its envelope (compact, sorted keys: one line's worth)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def digest_of(data: bytes) -> str:
    return sha256_bytes(data)


def subject_problems(bundle, document: dict) -> list[str]:
    """Each subject's digests against the bundle itself: a file subject by the sha256 of the bundle
    file it names (its bundle path, or its name under export/); a tree subject by the receipt's
    tree digest, the patched tree's also by the `sglang/` the exported wheel installs, and its
    gitTree by standards.json."""
    from pathlib import Path

    from backport.evidence import artifacts, vex
    from backport.evidence.layout import RECEIPT

    bundle = Path(bundle)
    receipt = json.loads((bundle / RECEIPT).read_bytes())
    trees = receipt["predicate"]["inputs"]["trees"]
    standards_path = bundle / vex.STANDARDS
    git = json.loads(standards_path.read_bytes()).get("git_trees", {}) if standards_path.is_file() else {}
    wheel = (receipt["predicate"].get("export") or {}).get("wheel")
    problems = []
    for subject in document.get("subject") or []:
        name, digest = subject.get("name", ""), subject.get("digest") or {}
        if name.endswith("-tree/sglang"):
            role = name[: -len("-tree/sglang")]
            tree = trees.get(role)
            if tree is None:
                problems.append(f"subject {name}: the receipt probed no {role} tree")
                continue
            value = digest.get("dirHash1", digest.get("sha256"))
            wants = [tree["tree_digest"]]
            if role == "patched" and wheel and (bundle / wheel["file"]).is_file():
                wants.append(artifacts.read_wheel((bundle / wheel["file"]).read_bytes())[0])
            if any(value != want for want in wants):
                problems.append(
                    f"subject {name}: tree digest {value} is not the tree's {', '.join(sorted(set(wants)))}"
                )
            if "gitTree" in digest and digest["gitTree"] != git.get(role):
                problems.append(
                    f"subject {name}: gitTree {digest['gitTree']} is not {git.get(role)} (standards.json)"
                )
            continue
        path = next((p for p in (bundle / name, bundle / "export" / name) if name and p.is_file()), None)
        if path is None:
            problems.append(f"subject {name}: no such file in the bundle")
        elif digest.get("sha256") != sha256_bytes(path.read_bytes()):
            problems.append(f"subject {name}: sha256 {digest.get('sha256')} is not the file's")
    return problems
