"""Files in shared directories, single-owner locks, and the endpoints they guard.

Everything dpboard keeps in a directory that other users can write (``/dev/shm``, ``/tmp``) follows
one rule (docs/SECURITY.md): a file is opened with ``O_NOFOLLOW`` (a symbolic link is refused, never
followed), created with ``O_EXCL`` (never an existing file of someone else), and checked after
opening: a regular file with one link, owned by this process's effective uid, that nobody else may
write. Anything else is refused with an ``AccessDeniedError`` naming the path, its owner and mode.

``OwnerLock`` is the single-owner lock built on it: an exclusive ``flock`` on such a file, which
holds the owner's pid and start time. The kernel drops the lock when its process dies, so a killed owner never
blocks its restart. The collector (one per board and per endpoint) and the controller (one per
``ipc://`` input, one per board) take it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import stat
import struct
import time
from pathlib import Path

from dpboard.errors import AccessDeniedError, DpboardError, InvalidInputError, UnavailableError

LOCK_DIR = Path("/dev/shm")
LOCK_PREFIX = "dpboard-"
_LOCK_KIND = re.compile(r"[a-z]+(?:\.[a-z]+)*")  # endpoint, collector.board, ...: never "sent"
# what lock_path makes, and nothing else: a board's sent record (dpboard-sent.<board>) is never taken
# for a lock file, even of a board named `m.lock` or `x.0123abcd.lock`
LOCK_FILE = re.compile(r"dpboard-(?!sent\.)[a-z]+(?:\.[a-z]+)*\.[A-Za-z0-9_.-]{0,80}\.[0-9a-f]{8}\.lock")
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_OPEN_ATTEMPTS = 100  # a file replaced between our open and our lock: open again, a bounded number of times
IPC_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL

# transport://address; ZMQ's own parser is lenient (a port of 99999 wraps to another port), so every
# endpoint dpboard binds or connects is checked here first, as a whole string (fullmatch).
_ENDPOINT = re.compile(r"(?P<transport>tcp|ipc|inproc|ws|wss|tipc|vmci|pgm|epgm)://(?P<address>\S+)")
_TCP_ADDRESS = re.compile(r"(?:(?P<source>\S+);)?(?P<host>\S+):(?P<port>\*|[0-9]{1,5})")


def user_name(uid: int) -> str | None:
    """The login name of ``uid`` here, or None."""
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return None


def describe_owner(uid: int) -> str:
    """``uid 1000 (alice)``, or just the uid when it has no name here."""
    name = user_name(uid)
    return f"uid {uid}" if name is None else f"uid {uid} ({name})"


def check_owned(st: os.stat_result, path: str | os.PathLike[str], what: str,
                trust_uids: tuple[int, ...] = (), *, hint: str | None = None) -> None:
    """Refuse (AccessDeniedError) a file that is not a regular file of ours (or of a trusted uid) that
    only its owner may write. ``hint`` replaces the advice given for a file of another user."""
    me = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        raise AccessDeniedError(f"{what} {path} is not a regular file (mode {stat.filemode(st.st_mode)}): "
                                f"remove it; dpboard does not use it")
    if st.st_uid != me and st.st_uid not in trust_uids:
        raise AccessDeniedError(
            f"{what} {path} belongs to {describe_owner(st.st_uid)} (mode {stat.S_IMODE(st.st_mode):#o}), "
            f"not to this process ({describe_owner(me)}): "
            + (hint or "dpboard uses only its own files in shared directories; run as that user, or remove "
                       "the file if nobody uses it")
        )
    if st.st_mode & 0o022:
        raise AccessDeniedError(
            f"{what} {path} is mode {stat.S_IMODE(st.st_mode):#o}: other users may write it, so its content "
            f"cannot be trusted; remove it (dpboard makes its files 0600)"
        )
    if st.st_nlink != 1:
        raise AccessDeniedError(f"{what} {path} has {st.st_nlink} hard links: it may be another file's "
                                f"alias; remove it")


def refuse_link(path: str | os.PathLike[str], what: str) -> DpboardError:
    """The error for a symbolic link where a dpboard file should be (an open with O_NOFOLLOW: ELOOP)."""
    return AccessDeniedError(f"{what} {path} is a symbolic link: dpboard never follows links in shared "
                             f"directories; remove it")


def open_refusal(error: OSError, path: str | os.PathLike[str], what: str) -> DpboardError | None:
    """The AccessDeniedError an O_NOFOLLOW open that failed with ``error`` means: a link in the
    file's place, or a file of another user; None for any other failure."""
    if error.errno == errno.ELOOP:
        return refuse_link(path, what)
    if error.errno == errno.EACCES:
        try:
            owner = describe_owner(os.lstat(path).st_uid)
        except OSError:
            owner = "another user"
        return AccessDeniedError(f"cannot open {what} {path}: it belongs to {owner}; run as that user, "
                                 f"or remove the file if nobody uses it")
    return None


def open_owned(path: str | os.PathLike[str], what: str, *, create: bool = True, mode: int = 0o600) -> int:
    """A read-write descriptor of ``path``: our own existing file, or a new one made with O_EXCL.

    Never follows a symbolic link; refuses a file that ``check_owned`` refuses."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_OPEN_ATTEMPTS):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if not create:
                raise
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
            except FileExistsError:
                continue  # someone created it in between: open that one (and check it)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise UnavailableError(f"cannot create {what} {path}: {e.strerror}" + _room_hint(e, path)) from None
            os.fchmod(fd, mode)  # exact, whatever the umask
        except OSError as e:
            refusal = open_refusal(e, path, what)
            if refusal is not None:
                raise refusal from None
            raise
        try:
            st = os.fstat(fd)
            if st.st_nlink == 0 and stat.S_ISREG(st.st_mode):
                os.close(fd)  # unlinked between our open and this look (`dpboard clean`): open again
                continue
            check_owned(st, path, what)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise UnavailableError(f"{what} {path} keeps being replaced by another process; retry")


def full_advice(folder: str | os.PathLike[str]) -> str:
    """How full ``folder`` is, and what to do about it: for the errors of a file system that is full."""
    try:
        fs = os.statvfs(folder)
        room = (f"{folder} is {fs.f_blocks * fs.f_frsize / 2**20:.1f} MiB with "
                f"{fs.f_bavail * fs.f_frsize / 2**20:.1f} MiB free")
    except OSError:
        room = f"{folder} is full"
    return (f"{room}; remove unused boards (`dpboard clean`) or give {folder} more room (a container's default "
            f"is 64 MiB: docker run --shm-size)")


def _room_hint(error: OSError, path: str | os.PathLike[str]) -> str:
    """``full_advice`` of the file's folder after a full file system's error (ENOSPC, EDQUOT), else nothing."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return ""
    return ": " + full_advice(os.path.dirname(os.fspath(path)))


def write_new_file(path: str | os.PathLike[str], data: bytes, what: str, *, mode: int = 0o600) -> None:
    """Create ``path`` with O_EXCL | O_NOFOLLOW and write ``data``: never an existing file or a link."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:
        raise AccessDeniedError(f"{what} {path} exists already") from None
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)


# -- single-owner locks ----------------------------------------------------------------------------


def lock_path(kind: str, key: str) -> Path:
    """``/dev/shm/dpboard-<kind>.<readable key>.<hash>.lock``: one file per thing that has one owner."""
    if not _LOCK_KIND.fullmatch(kind) or kind == "sent" or kind.startswith("sent."):
        raise InvalidInputError(f"lock kind {kind!r}: lower-case words joined by dots, and not 'sent' (the sent "
                                f"records' prefix)")
    return LOCK_DIR / f"{LOCK_PREFIX}{kind}{_lock_suffix(key)}"


class OwnerBusyError(UnavailableError):
    """Another live process owns what the lock guards."""


class OwnerLock:
    """An exclusive ``flock`` on a lock file that holds the owner's pid and start time; released when the process dies.

    ``what`` names the guarded thing in errors ("board 'x'", "endpoint ipc:///tmp/in"); ``busy``
    is the error class raised when another process holds it, ``hint`` what to do then."""

    def __init__(self, path: Path, what: str, *, busy: type[OwnerBusyError] = OwnerBusyError,
                 role: str = "owner", hint: str = "stop it first"):
        self.path = path
        self._fd: int | None = None
        # A file unlinked by its previous owner between our open and our flock would give us a lock
        # nobody else can see: open again until the locked file is the one the path names.
        for attempt in range(_OPEN_ATTEMPTS):
            fd = open_owned(path, f"the lock file of {what}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder, holder_ticks = _read_owner(fd)
                replaced = not same_file(fd, path)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                # Only an owner the file names with its start time, and that runs, is one for sure. The
                # flock may be `dpboard clean`'s, held a moment while it removes an abandoned file that
                # names a dead owner, or a pid alone (an older dpboard's file; pid 1 of a container's
                # earlier run), or nobody yet (a starter about to write its pid): look again (bounded).
                sure = bool(holder_ticks) and process_alive(holder, holder_ticks)
                if (replaced or not sure) and attempt < _OPEN_ATTEMPTS - 1:
                    time.sleep(0.001)
                    continue
                who = f"pid {holder}" if holder else "a process that is still starting"
                raise busy(f"{what} already has {role}: {who} (lock {path}); {hint}") from None
            if same_file(fd, path):
                pid = os.getpid()
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{pid} {process_start_ticks(pid)}\n".encode(), 0)
                except OSError as e:
                    # A full /dev/shm (ENOSPC): we hold the lock, so the file is ours to take back.
                    path.unlink(missing_ok=True)
                    os.close(fd)
                    raise UnavailableError(f"cannot write the lock file {path} of {what}: {e.strerror}"
                                           + _room_hint(e, path)) from None
                self._fd = fd
                return
            os.close(fd)
        raise busy(f"could not take the lock {path}: it keeps being replaced by another process")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if same_file(fd, self.path):
                self.path.unlink(missing_ok=True)  # still holding the lock: nobody can be inside it
        finally:
            os.close(fd)

    def __enter__(self) -> OwnerLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock_suffix(key: str) -> str:
    """How ``lock_path`` ends every lock file of ``key``, whatever its kind."""
    return f".{_SAFE.sub('_', key)[:80]}.{hashlib.sha1(key.encode()).hexdigest()[:8]}.lock"


def remove_abandoned_locks(min_age: float = 10.0, *, keys: tuple[str, ...] | None = None) -> list[Path]:
    """Remove this user's lock files that no live process holds: an owner killed with SIGKILL loses
    its flock with its life but leaves the file. Taking the flock is the test; the file is unlinked
    while it is held, so every later taker opens a fresh one. A file younger than ``min_age`` seconds
    is left alone (its owner may be between creating and locking it), and ``OwnerLock`` looks again
    when it meets a lock held by no live pid, which is what this function's brief hold looks like.
    ``keys``: only the lock files of these keys (a board name, an ``endpoint_lock_key``), of any kind."""
    removed = []
    now = time.time()
    suffixes = None if keys is None else tuple(_lock_suffix(k) for k in keys)
    for path in sorted(LOCK_DIR.glob(f"{LOCK_PREFIX}*.lock")):
        if not LOCK_FILE.fullmatch(path.name):
            continue  # not a lock file (a board's sent record may end in .lock too)
        if suffixes is not None and not path.name.endswith(suffixes):
            continue
        try:
            if now - path.lstat().st_mtime < min_age:
                continue
            fd = open_owned(path, f"lock file {path.name}", create=False)
        except (DpboardError, OSError):
            continue  # another user's file, or one that vanished meanwhile: not ours to remove
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live owner holds it
        try:
            if same_file(fd, path):
                path.unlink(missing_ok=True)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


# -- open-file-description locks on byte ranges ----------------------------------------------------
#
# A process that holds a board's slot, a side record's row, or a board it created, holds an OFD
# write lock on those bytes: the kernel drops it when the process dies, and any process (another
# user's, another PID or time namespace's) can ask whether it is held. It is the second proof of life
# beside an owner word's pid and start ticks, which a time namespace shows differently to others.
# Only a write lock is a proof: anybody who may read the file can take a read lock.

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on x86-64 / aarch64 Linux


def lock_range(fd: int, start: int, length: int, *, shared: bool = False) -> bool:
    """Take an OFD lock on ``length`` bytes of ``fd`` from ``start`` (0: to the end and beyond);
    False when another open file description holds a conflicting one."""
    kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock_range(fd: int, start: int, length: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, length, 0))


def write_lock_held(fd: int, start: int = 0, length: int = 0) -> bool:
    """Whether another open file description holds a *write* lock on any of those bytes (a read-only
    ``fd`` asks too): the question "does a writer, a creator or a row's holder live" for a file that
    others may read. Anybody who may read a file can take a read lock on any of its bytes, so a read
    lock proves nothing; a write lock needs a descriptor open for writing, which only the file's
    owner has (docs/SECURITY.md). Asked with F_RDLCK, F_OFD_GETLK reports only write locks."""
    found = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, start, length, 0))
    return _FLOCK.unpack(found)[0] != fcntl.F_UNLCK


def any_lock_held(fd: int, start: int = 0, length: int = 0) -> bool:
    """Whether another open file description holds any lock, read or write, on those bytes. Only for
    a file nobody but its owner may open (a side record, mode 0600, whose attachers share read
    locks): on a file others may read, their read locks would count (``write_lock_held`` there)."""
    found = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    return _FLOCK.unpack(found)[0] != fcntl.F_UNLCK


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists (ours or another user's)."""
    if not 0 < pid < 2**31:  # a corrupt record: no process has such a pid (and os.kill would overflow)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return True


def process_start_ticks(pid: int) -> int:
    """Start time of a process in clock ticks since boot (0 when it does not exist)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    try:
        return int(stat_line[stat_line.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return 0


def process_alive(pid: int, start_ticks: int = 0) -> bool:
    """True when ``pid`` runs (and, when ``start_ticks`` is given, started at that time): a pid
    alone is no identity, pids are recycled."""
    if not pid_alive(pid):
        return False
    if start_ticks:
        return process_start_ticks(pid) == start_ticks
    return True


def process_exited(pid: int) -> bool:
    """True when ``pid`` and every thread of it have exited (reaped or not). A thread-group leader
    shows as a zombie while its other threads (a BLAS pool's) are still exiting with its files, and
    so its locks, still open: it has exited only once it is the last task left."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        if state not in (b"Z", b"X"):
            return False
        return os.listdir(f"/proc/{pid}/task") in ([], [str(pid)])
    except (OSError, IndexError):
        return True


def same_file(fd: int, path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` still names the file open at ``fd`` (no link followed)."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)


def _read_owner(fd: int) -> tuple[int, int]:
    """(pid, start ticks) a lock file holds; ticks 0 in a file of an older dpboard (pid only)."""
    try:
        words = os.pread(fd, 64, 0).split()
        return int(words[0]), int(words[1]) if len(words) > 1 else 0
    except (OSError, ValueError, IndexError):
        return 0, 0


# -- endpoints ---------------------------------------------------------------------------------


def check_endpoint(endpoint: object, what: str, *, bind: bool) -> str:
    """``endpoint`` if it is a whole, well-formed ZMQ endpoint, else an InvalidInputError naming it.

    TCP ports must be in 1..65535 (``*`` or 0, a free port, only where ``bind``); an ipc path must fit
    a Unix socket address."""
    m = _ENDPOINT.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if m is None:
        raise InvalidInputError(
            f"{what} {endpoint!r} is not a ZMQ endpoint: write transport://address, e.g. "
            f"tcp://10.0.0.1:5757 or ipc:///tmp/dpboard-in"
        )
    transport, address = m["transport"], m["address"]
    if transport == "tcp":
        t = _TCP_ADDRESS.fullmatch(address)
        if t is None:
            raise InvalidInputError(f"{what} {endpoint!r} needs a host and a port: tcp://HOST:PORT")
        port = t["port"]
        if port == "*" or int(port) == 0:
            if not bind:
                raise InvalidInputError(f"{what} {endpoint!r}: a free port (* or 0) can only be bound, "
                                        f"not connected to; give the port")
        elif not 1 <= int(port) <= 65535:
            raise InvalidInputError(f"{what} {endpoint!r}: port {int(port)} is outside 1..65535")
    elif transport == "ipc":
        if len(os.fsencode(address)) > IPC_PATH_MAX:
            raise InvalidInputError(f"{what} {endpoint!r}: an ipc path is at most {IPC_PATH_MAX} bytes; "
                                    f"use a shorter path")
    return endpoint


def endpoint_lock_key(endpoint: str) -> str | None:
    """What two owners of an endpoint must not share: a TCP port (binding one port on two interfaces
    clashes anyway, and the lock can then name the owner), the absolute path of an ipc endpoint, or
    the endpoint itself; None for a free TCP port (unique by construction)."""
    if endpoint.startswith("tcp://"):
        port = endpoint.rsplit(":", 1)[-1]
        if port in ("*", "0"):
            return None
        return f"tcp-port-{int(port)}"
    if endpoint.startswith("ipc://"):
        return "ipc-" + os.path.abspath(endpoint[len("ipc://") :])
    return endpoint


def endpoint_lock_path(endpoint: str) -> Path | None:
    """The lock of a bound endpoint, shared by every dpboard process that binds one (the collector,
    the controller's input); None for a free TCP port."""
    key = endpoint_lock_key(endpoint)
    return None if key is None else lock_path("endpoint", key)


def take_endpoint(endpoint: str, *, busy: type[OwnerBusyError] = OwnerBusyError) -> OwnerLock | None:
    """The single-owner lock of an endpoint about to be bound (None for a free TCP port): ZMQ lets a
    second ``ipc://`` bind silently take the path over from the first, so dpboard refuses it first."""
    path = endpoint_lock_path(endpoint)
    if path is None:
        return None
    return OwnerLock(path, f"endpoint {endpoint}", busy=busy, role="an owner",
                     hint="a second bind would silently take an ipc path over, or fail on a tcp port: stop "
                          "that process, or pick another endpoint")
