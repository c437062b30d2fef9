"""What a SIGKILL leaves in `.git` beyond the work tree (issue 43 rows 12-13): the ref locks of
`git update-ref` held at the kill, the pack's temporary files, a pack without its index. Recovery
removes this toolkit's own (named by its journal) and never a lock a user's git holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from backport.engine import apply_series, recover_checkout
from backport.engine.write import FAULT_LOG, FAULT_PAUSE
from backport.errors import BadInput
from backport.pack import load_pack
from tests.conftest import REPO as REPO_ROOT
from tests.engine_helpers import leftovers, run_git, snapshot, tree_state, write_files
from tests.test_engine import STEPS, _killed_run, _recovered, crash_kit  # noqa: F401 - crash_kit: a fixture


def _locks(repo: Path) -> list[Path]:
    return [repo / ".git" / "HEAD.lock", repo / ".git" / "refs" / "heads" / "main.lock"]


def _holding_git(bin_dir: Path) -> dict[str, str]:
    """A `git` first on PATH whose `update-ref --stdin` takes its locks (`prepare`) and holds them,
    as the engine's git does for the instant of the commit point: a SIGKILL of the group then
    leaves real git's locks behind."""
    import shutil

    real = shutil.which("git")
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "git"
    script.write_text("#!/bin/sh\n"
                      'case " $* " in *" update-ref "*" --stdin "*)\n'
                      f'  {{ echo start; cat; echo prepare; sleep 60; }} | "{real}" "$@"; exit $?;;\n'
                      "esac\n"
                      f'exec "{real}" "$@"\n')
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_sigkill_while_update_ref_holds_the_locks_is_recovered(crash_kit):  # noqa: F811
    tmp = crash_kit[0]
    env = _holding_git(tmp / "bin-holding")
    name = "locks-held"
    locks = _locks(tmp / name)
    repo, how = _killed_run(crash_kit, name, env, lambda: all(p.exists() for p in locks))
    assert "rc=-9" in how, how
    assert all(p.exists() for p in locks)  # git's own locks, left by the kill
    assert locks[1].read_text() == f"{crash_kit[4]['head']}\n"  # git wrote the series' commit into it
    found, state = _recovered(crash_kit, repo)  # recovery, then the next apply ends patched
    assert (found, state) == ("half", "pristine") and not any(p.exists() for p in locks)


def test_a_lock_no_journal_names_is_left_alone_with_one_line(crash_kit):  # noqa: F811
    tmp, template, pack_root, _, _ = crash_kit
    repo = tmp / "foreign-lock"
    run_git(tmp, "clone", "-q", str(template), str(repo))
    write_files(repo, {"sglang/_version.py": "__version__ = version = '0.5.19'\n"})  # for the CLI
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-q", "-m", "release 0.5.19")
    run_git(repo, "tag", "v0.5.19")
    before = snapshot(repo)
    lock = repo / ".git" / "HEAD.lock"
    lock.write_bytes(b"")  # a user's git, updating HEAD right now (or killed)
    with pytest.raises(BadInput, match="no journal of this toolkit names it") as refused:
        apply_series(repo, load_pack(pack_root), "0.5.19")
    assert "\n" not in str(refused.value) and str(lock) in str(refused.value)
    done = subprocess.run(
        [sys.executable, "-m", "backport.cli", "apply", str(repo), "--series", str(pack_root), "--json"],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 2 and done.stdout.count("\n") == 1, done
    assert "HEAD.lock: exists and no journal" in json.loads(done.stdout)["error"]["message"]
    assert lock.exists() and snapshot(repo) == before


def test_recovery_leaves_a_lock_its_journal_names_but_another_git_made(crash_kit):  # noqa: F811
    """Killed before the commit point, the journal names the ref locks; a lock at that path holding
    another commit is a concurrent git's: recovery rolls the tree back and leaves it."""
    step = STEPS.index("head") + 1
    log = crash_kit[0] / "other-git.log"
    repo, how = _killed_run(crash_kit, "other-git", {FAULT_LOG: str(log), FAULT_PAUSE: str(step)},
                            lambda: log.exists() and len(log.read_text().splitlines()) >= step)
    assert "rc=-9" in how, how
    branch_lock = _locks(repo)[1]
    branch_lock.write_text(f"{'ab' * 20}\n")  # a user's update-ref of main, in flight
    said = recover_checkout(repo)
    assert "rolled back" in said and branch_lock.exists()
    assert tree_state(repo, crash_kit[3], crash_kit[4]) == "pristine"
    with pytest.raises(BadInput, match=r"main.lock: exists and no journal"):
        apply_series(repo, load_pack(crash_kit[2]), "0.5.19")
    branch_lock.unlink()  # that git finished
    assert apply_series(repo, load_pack(crash_kit[2]), "0.5.19").head_commit == crash_kit[4]["head"]


KILL_IN_PACK = """\
import os, signal, sys
from pathlib import Path
from backport.engine import apply_series, objects
from backport.pack import load_pack

where, real_write, real_replace = sys.argv[3], objects._write_whole, os.replace

def write_whole(fd, data):
    if where == "pack-torn":
        os.write(fd, data[:len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    real_write(fd, data)
    if where == "idx-written" and data[:4] == b"\\377tOc":
        os.kill(os.getpid(), signal.SIGKILL)

def replace(src, dst, *args, **kwargs):
    if where == "pack-renamed" and str(dst).endswith(".idx"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst, *args, **kwargs)

objects._write_whole, os.replace = write_whole, replace
apply_series(Path(sys.argv[1]), load_pack(sys.argv[2]), "0.5.19")
"""


@pytest.mark.parametrize("where", ["pack-torn", "idx-written", "pack-renamed"])
def test_sigkill_during_the_pack_write_leaves_nothing_after_recovery(crash_kit, where):  # noqa: F811
    tmp, template, pack_root, _, _ = crash_kit
    repo = tmp / f"pack-{where}"
    run_git(tmp, "clone", "-q", str(template), str(repo))
    done = subprocess.run(
        [sys.executable, "-c", KILL_IN_PACK, str(repo), str(pack_root), where],
        check=False,
        cwd=tmp,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-800:]
    left = leftovers(repo)
    assert any(n.startswith("tmp_") or n.endswith(".pack") for n in left), left  # what the kill left
    _recovered(crash_kit, repo)  # leftovers() == [] once recovered, then the next apply ends patched
    run_git(repo, "fsck", "--full", "--strict")


def test_rollback_keeps_a_pack_that_was_there_before(crash_kit):  # noqa: F811
    """The same series applied, taken back by the user (`git reset`: its commits stay in the reflog),
    then applied again and killed before the commit point: the pack of that name was not this run's,
    so recovery keeps it and the reflog's commits stay readable."""
    tmp, template, pack_root, pristine, patched = crash_kit
    repo = tmp / "pack-kept"
    run_git(tmp, "clone", "-q", str(template), str(repo))
    apply_series(repo, load_pack(pack_root), "0.5.19")
    packs = sorted(p.name for p in (repo / ".git" / "objects" / "pack").iterdir())
    run_git(repo, "reset", "-q", "--hard", pristine["head"])
    log, step = tmp / "pack-kept.log", STEPS.index("journal") + 1
    env = {**os.environ, FAULT_LOG: str(log), FAULT_PAUSE: str(step), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILL_IN_PACK, str(repo), str(pack_root), "none"], env=env,
                            start_new_session=True)
    while not (log.exists() and len(log.read_text().splitlines()) >= step):
        assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert "rolled back" in recover_checkout(repo) and leftovers(repo) == []
    assert sorted(p.name for p in (repo / ".git" / "objects" / "pack").iterdir()) == packs
    run_git(repo, "cat-file", "-e", patched["head"])  # HEAD@{1} still has its objects
    run_git(repo, "fsck", "--full", "--strict")
