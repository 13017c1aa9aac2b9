"""The cache folder models are prepared into: where it is, the temporary names work in progress carries, the sweep
of work that a killed start left behind, and a full disk said as such."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from utils.models.load_error import ModelLoadError
from utils.paths import expand_user
from utils.printing import one_line

# Work of another machine or pid namespace cannot be judged by its pid; nothing legitimate takes this long.
FOREIGN_WORK_EXPIRES_S = 24 * 3600
NEARLY_FULL = 64 << 20  # bytes free below which a failed write is taken for a full disk
# When this start began, as far as the cache can tell: every entry it marks (`mark_used`, defined here) or makes
# has a later modification time; entries it has not touched, an earlier one.
STARTED = time.time()
_held: set[str] = set()  # the locks of `one_start_at_a_time` this process holds


def expand(text: str, what: str) -> Path:
    """`text` as an absolute path (a relative one from here): a kernel build's Ctrl-C finds its compilers by the
    absolute folder they run in (`qkernels.stop_compilers`), which a relative name never matched."""
    try:
        return expand_user(text).absolute()
    except ValueError as error:  # "~name/…" where this system knows no user "name"
        raise ModelLoadError(f"{what}{text}: {error}") from None


def cache_root() -> Path:
    if os.environ.get("SPECDEC_CACHE_DIR"):
        return expand(os.environ["SPECDEC_CACHE_DIR"], "SPECDEC_CACHE_DIR=")
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (expand(xdg, "XDG_CACHE_HOME=") if xdg else Path.home() / ".cache") / "specdec"


def writable_cache_root() -> Path:
    """The cache folder, created if needed: one line naming it when it cannot be written (a file in its path,
    no permission), instead of a traceback from deep inside a conversion."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()
    except OSError as error:
        why = "a file is there, not a folder" if root.exists() and not root.is_dir() else (
            error.strerror or one_line(error))  # mkdir's own reason for a file there: "File exists"
        raise ModelLoadError(f"the cache folder {root} cannot be written ({why}); "
                             "set SPECDEC_CACHE_DIR to a writable folder") from None
    return root


@lru_cache(maxsize=1)
def host_key() -> str:
    """Names where our pids mean something: this boot of this machine and this pid namespace. A cache shared by
    containers or over NFS holds others' work, whose pids say nothing here (the boot id is per machine and boot,
    the namespace per container; the host name covers systems without /proc)."""
    parts = [socket.gethostname()]
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                 lambda: os.readlink("/proc/self/ns/pid")):
        try:
            parts.append(read())
        except OSError:
            pass
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def work_prefix(name: str) -> str:
    """Temporary names in the cache carry where and by which pid they are written, so a later start can tell an
    abandoned one (SIGKILL, power loss: no handler runs) from one a running start is still writing."""
    return f".{name}.{host_key()}.pid{os.getpid()}."


WORK_NAME = re.compile(r"\..*?(?:\.([0-9a-f]{12}))?\.pid(\d+)\..*")  # work_prefix's form; older ones had no key


def sweep_abandoned_work() -> None:
    """Removes temporary folders and files of conversions whose process is gone: ours by pid, those of another
    machine or container (or of an older version, which named no host) only once they are a day old."""
    try:
        entries = list(cache_root().iterdir())
    except OSError:
        return
    for entry in entries:
        match = WORK_NAME.fullmatch(entry.name)
        if not match:
            continue
        if match.group(1) == host_key():
            abandoned = not process_alive(int(match.group(2)))
        else:
            try:
                abandoned = time.time() - entry.lstat().st_mtime > FOREIGN_WORK_EXPIRES_S
            except OSError:
                continue
        if abandoned:
            remove(entry)


@contextmanager
def one_start_at_a_time(root: Path, what: str, doing: str, progress: bool = True) -> Iterator[None]:
    """Work two starts on one cache folder would both do at once (the kernel build, a model's preparation): the
    second waits for the first, saying that another start is `doing` it, then finds it done. Two first starts at
    once each built and prepared everything (308 s each on the Zen 4 of benchmarks/RESULTS.md, against ~55 s
    alone) and timed the kernels on a machine the other was loading (16 ms for kernels of 0.3 ms), keeping the
    choice that gave. An flock on a dot file (`what`): the OS releases it when a process dies, so a killed start
    leaves no lock behind. Where none can be taken (not POSIX, a cache that cannot be written), as before."""
    if os.name != "posix" or what in _held:
        yield
        return
    import fcntl

    try:
        fd = os.open(root / f".{what}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another start {doing} in {root}…", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        _held.add(what)
        yield
    finally:
        _held.discard(what)
        os.close(fd)


def write_in_one_step(path: Path, data: bytes) -> bool:
    """Writes `data` at `path` through a temporary dot file beside it, renamed into place: readers see the old file
    or the whole new one. False, leaving nothing behind, where the folder cannot be written or the disk is full.
    Created as `open` creates a file, the umask applied (mkstemp's 0600 left a cache one user prepared unreadable
    to the others sharing it)."""
    tmp = path.parent / f".tmp-{path.name}-{secrets.token_hex(6)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        return False
    finally:  # Ctrl-C and SIGTERM too: a dot file of this name no sweep would ever find
        tmp.unlink(missing_ok=True)
    return True


def mark_used(entry: Path) -> None:
    """Sets `entry`'s modification time to now: its last use, as `cache_prune` reads it."""
    try:
        os.utime(entry)
    except OSError:
        pass  # a read-only cache: no start prunes it either


def remove(entry: Path) -> None:
    """Removes a folder, a file or a link, whichever is at `entry`, as far as this user may: a cache shipped
    read-only (an image) is left as it is, its callers check what remains."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        try:
            entry.unlink()
        except OSError:  # gone already, or a folder this user may not write
            pass


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


class FullDiskError(ModelLoadError):
    """A full disk, said in one line (`full_disk`): a model load error that freeing space can mend."""


def full_disk(error: BaseException, where: Path) -> FullDiskError | None:
    """A one-line error when `error` came from a full disk, else None. Writers deep in torch report it as
    "[enforce fail at inline_container.cc] unexpected pos", without an errno, so for a write's errors (OSError,
    RuntimeError) the free space decides; any other error (a damaged file, a checksum) is what it says."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        full = True
    elif any(os.strerror(code) in str(error) for code in (errno.ENOSPC, errno.EDQUOT)):
        full = True  # safetensors' writer: a SafetensorError, "… No space left on device (os error 28)"
    elif not isinstance(error, (OSError, RuntimeError)):
        full = False
    else:
        try:
            full = shutil.disk_usage(where).free < NEARLY_FULL
        except OSError:
            full = False
    if not full:
        return None
    return FullDiskError(f"the disk holding {where} is full; free some space there, or set SPECDEC_CACHE_DIR to a "
                         "folder on another disk, and start again")
