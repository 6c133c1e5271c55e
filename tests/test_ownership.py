"""Files in shared directories and single-owner locks, against what a hostile local user (a real
uid 65534 process) or a careless one leaves there: links, other users' files, loose modes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dpboard.errors import AccessDeniedError, InvalidInputError
from dpboard.ownership import (
    LOCK_DIR,
    OwnerBusyError,
    OwnerLock,
    check_endpoint,
    endpoint_lock_path,
    lock_path,
    open_owned,
    write_new_file,
)
from tests.support.names import new_board_name
from tests.support.other_user import as_nobody
from tests.support.sweeps import sweeping


@pytest.fixture
def shared_path():
    """A fresh path in /dev/shm (the shared directory locks live in), removed afterwards."""
    path = lock_path("endpoint", f"test-{new_board_name()}")
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def victim(tmp_path):
    """A root-owned 0600 file that must never change."""
    v = tmp_path / "victim"
    v.write_text("root's secret\n")
    v.chmod(0o600)
    return v


def test_a_new_file_is_ours_and_0600_whatever_the_umask(shared_path):
    old = os.umask(0)
    try:
        fd = open_owned(shared_path, "test file")
    finally:
        os.umask(old)
    os.close(fd)
    st = shared_path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    os.close(open_owned(shared_path, "test file"))  # and it opens again


def test_a_link_planted_by_another_user_is_never_followed(shared_path, victim):
    as_nobody(lambda: os.symlink(victim, shared_path))
    with pytest.raises(AccessDeniedError, match=f"{shared_path} is a symbolic link"):
        open_owned(shared_path, "test file")
    with pytest.raises(AccessDeniedError, match="is a symbolic link"):
        OwnerLock(shared_path, "thing")
    assert victim.read_text() == "root's secret\n" and shared_path.is_symlink()


def test_a_file_of_another_user_is_refused_naming_owner_and_mode(shared_path):
    def plant() -> None:
        fd = os.open(shared_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.fchmod(fd, 0o666)
        os.write(fd, b"4242\n")
        os.close(fd)

    as_nobody(plant)
    with pytest.raises(AccessDeniedError, match=r"belongs to uid 65534 \(nobody\) \(mode 0o666\), not to this "
                                                r"process \(uid 0 \(root\)\)"):
        OwnerLock(shared_path, "board 'x'")


def test_loose_modes_hard_links_and_non_files_are_refused(shared_path, tmp_path):
    fd = os.open(shared_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    shared_path.chmod(0o620)
    with pytest.raises(AccessDeniedError, match="is mode 0o620: other users may write it"):
        open_owned(shared_path, "test file")
    shared_path.chmod(0o600)
    alias = shared_path.with_name(shared_path.name + ".alias")
    os.link(shared_path, alias)
    try:
        with pytest.raises(AccessDeniedError, match="has 2 hard links"):
            open_owned(shared_path, "test file")
    finally:
        alias.unlink()
    shared_path.unlink()
    os.mkfifo(shared_path, 0o600)
    with pytest.raises(AccessDeniedError, match="is not a regular file"):
        open_owned(os.fspath(shared_path), "test file")  # a FIFO opened O_RDWR does not block


def test_write_new_file_never_replaces_anything(tmp_path, victim):
    target = tmp_path / "key"
    target.symlink_to(victim)
    with pytest.raises(AccessDeniedError, match="exists already"):
        write_new_file(target, b"x", "key")
    assert victim.read_text() == "root's secret\n"
    fresh = tmp_path / "fresh"
    write_new_file(fresh, b"data", "key", mode=0o644)
    assert fresh.read_bytes() == b"data" and stat.S_IMODE(fresh.stat().st_mode) == 0o644


def _hold_lock(path: Path) -> subprocess.Popen:
    """A process holding the OwnerLock of ``path`` until killed."""
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys
from pathlib import Path
from dpboard.ownership import OwnerLock
lock = OwnerLock(Path({str(path)!r}), "thing")
print("held", flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_an_owner_lock_names_its_holder_and_dies_with_it(shared_path):
    holder = _hold_lock(shared_path)
    try:
        with pytest.raises(OwnerBusyError, match=rf"thing already has owner: pid {holder.pid} \(lock {shared_path}\)"):
            OwnerLock(shared_path, "thing")
    finally:
        holder.kill()  # no clean exit: the kernel drops the lock, the file stays
        holder.wait(10)
    with OwnerLock(shared_path, "thing") as lock:
        assert lock.held and shared_path.read_text().split()[0] == str(os.getpid())
    assert not shared_path.exists()


def test_clean_removes_the_lock_files_that_killed_owners_left_and_nothing_else(shared_path):
    dead, live = shared_path, lock_path("endpoint", f"test-{new_board_name()}")
    young = lock_path("endpoint", f"test-{new_board_name()}")
    theirs = lock_path("endpoint", f"test-{new_board_name()}")
    killed, holder = _hold_lock(dead), _hold_lock(live)
    try:
        killed.kill()  # SIGKILL: the kernel drops its flock, the file stays
        killed.wait(10)
        young.write_text("1\n")  # an owner may be between creating and locking this one
        as_nobody(lambda: os.close(os.open(theirs, os.O_CREAT | os.O_WRONLY, 0o600)))
        old = dead.stat().st_mtime - 3600
        for path in (dead, live, theirs):
            os.utime(path, (old, old), follow_symlinks=False)
        with sweeping():
            out = subprocess.run([sys.executable, "-m", "dpboard", "clean"], capture_output=True, text=True,
                                 timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"removed {dead} (a lock no live process holds)" in out.stdout
        assert not dead.exists()
        assert live.exists() and young.exists() and theirs.exists()
        assert str(live) not in out.stdout and str(young) not in out.stdout and str(theirs) not in out.stdout
        with pytest.raises(OwnerBusyError, match=f"pid {holder.pid}"):  # still its holder's
            OwnerLock(live, "thing")
    finally:
        for p in (killed, holder):
            p.kill()
            p.wait(10)
        for path in (live, young, theirs):
            path.unlink(missing_ok=True)


def test_a_lock_held_a_moment_by_its_remover_is_taken_once_it_is_gone(shared_path):
    """`dpboard clean` holds an abandoned lock (its recorded pid dead) while it unlinks it; an owner
    starting in that moment takes a fresh lock instead of reporting the dead pid as busy."""
    shared_path.write_text("999999999\n")  # no such pid
    remover = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys, time
fd = os.open({str(shared_path)!r}, os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
time.sleep(0.03)
os.unlink({str(shared_path)!r})
os.close(fd)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert remover.stdout.readline().strip() == "holding"
        with OwnerLock(shared_path, "thing") as lock:
            assert lock.held and shared_path.read_text().split()[0] == str(os.getpid())
    finally:
        remover.kill()
        remover.wait(10)


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:5757", "tcp://*:5757", "tcp://[::1]:80", "tcp://eth0:1", "ipc:///tmp/dp-in", "inproc://x",
])
def test_good_endpoints(endpoint):
    assert check_endpoint(endpoint, "--x", bind=True) == endpoint


@pytest.mark.parametrize(("endpoint", "words"), [
    ("tcp://127.0.0.1:99999", "port 99999 is outside 1..65535"),  # ZMQ would bind another port
    ("tcp://127.0.0.1:5757\n", "is not a ZMQ endpoint"),
    ("tcp://127.0.0.1", "needs a host and a port"),
    ("bogus", "is not a ZMQ endpoint"),
    ("ipc://", "is not a ZMQ endpoint"),
    ("ipc:///" + "x" * 200, "at most 107 bytes"),
    ("", "is not a ZMQ endpoint"),
])
def test_bad_endpoints_are_refused_whole(endpoint, words):
    with pytest.raises(InvalidInputError, match=words):
        check_endpoint(endpoint, "--x", bind=True)


def test_a_free_port_is_bound_not_connected():
    assert check_endpoint("tcp://127.0.0.1:*", "--bind", bind=True)
    with pytest.raises(InvalidInputError, match="can only be bound"):
        check_endpoint("tcp://127.0.0.1:0", "--to", bind=False)
    assert endpoint_lock_path("tcp://127.0.0.1:*") is None
    assert endpoint_lock_path("ipc://rel/path") == lock_path("endpoint", "ipc-" + os.path.abspath("rel/path"))
    assert endpoint_lock_path("tcp://10.0.0.1:5757") == endpoint_lock_path("tcp://127.0.0.1:5757")


def test_lock_paths_stay_in_the_lock_directory():
    p = lock_path("endpoint", "ipc-/tmp/../../etc/passwd\n")
    assert p.parent == LOCK_DIR and "/" not in p.name and "\n" not in p.name
    assert Path(p).name.startswith("dpboard-endpoint.")


_FULL_SHM_LOCKS = """
import json, os, subprocess, sys
from dpboard.board import Board
board = Board.create("full", 1)
fd = os.open("/dev/shm/filler", os.O_WRONLY | os.O_CREAT, 0o600)
for chunk in (1 << 16, 1 << 12, 1):  # every last page of the tmpfs taken
    try:
        while True:
            os.write(fd, bytes(chunk))
    except OSError:
        pass
os.close(fd)
out = {}
for argv in (["controller", "--board", "full", "--input", "ipc:///tmp/dpboard-full-in", "--workers",
              "ipc:///tmp/dpboard-full-w0", "--duration", "5"],
             ["collect", "--board", "full", "--bind", "tcp://127.0.0.1:0", "--duration", "5"]):
    run = subprocess.run([sys.executable, "-m", "dpboard.cli", *argv], capture_output=True, text=True, timeout=60)
    out[argv[0]] = [run.returncode, run.stderr]
out["left"] = sorted(n for n in os.listdir("/dev/shm") if n.endswith(".lock"))
os.unlink("/dev/shm/filler")
board.close()
board.unlink()
print(json.dumps(out))
"""


def test_a_lock_file_on_a_full_dev_shm_is_one_line_and_leaves_nothing():
    """`controller --board` and `collect` on a full /dev/shm (a private 1 MiB tmpfs, every page
    taken): the lock file's first write fails with ENOSPC; each says so in one line, with the room
    left and the fix, exits 2, and leaves no (empty) lock file behind."""
    import json

    from tests.support.private_shm import run_in_private_shm

    run = run_in_private_shm(_FULL_SHM_LOCKS, size="1m", label="dpboard-full", timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    for command in ("controller", "collect"):
        status, stderr = out[command]
        assert status == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, (command, stderr)
        assert "No space left on device" in stderr and "/dev/shm is 1.0 MiB with 0.0 MiB free" in stderr, stderr
    assert out["left"] == []
