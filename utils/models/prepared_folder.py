"""A prepared model folder in the cache, and the record of what a complete one holds.

`publish_folder` has the folder written inside a work folder, records every file in it (name, size, CRC-32), and
moves it into place in one step. `folder_problem` compares a folder with its record at each load: a deleted,
truncated or altered file (a lost tokenizer.json would leave a 2-token tokenizer that reads no prompt; random
bytes inside the state would load silently) is named in one line and the folder prepared again from its source.
CRC-32 detects damage, not tampering (whoever can write the folder can write its record), at 2-3 GB/s: the
prepared default pair (1.6 GB) cost 0.5-1.1 s of every warm start.

So a file found intact is not read again while its stat is unchanged, as git trusts its index: a dot file beside
the record (`STAMP`) keeps each checked file's device, inode, size, modification and change times. Any write to
a file moves its change time, which no program can set back, so damage by a write (even one that keeps the size
and restores the modification time) still fails the stat and the file is read again. A file changed less than
`SETTLED_NS` before its check is not stamped: a second write in the same timestamp tick would leave its stat as
it was. Not seen by a stat: bits that rot on the disk beneath the filesystem, which a read every start would catch.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

from utils.models.cache_folder import (FullDiskError, full_disk, mark_used, remove, work_prefix, writable_cache_root,
                                       write_in_one_step)

SOURCE_MARKER = "specdec-source.json"  # the record, written last: a folder without it is an unfinished conversion
RECORD_VERSION = 2  # 1 named the source only; such folders are prepared again, to gain a record
CHUNK = 8 << 20
STAMP = ".specdec-checked.json"  # a dot file: outside the record (`listed`); the files last found intact, by stat
SETTLED_NS = 2 * 10**9  # a file's change time must be this much older than its check for the check to be stamped


def checksum(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def listed(folder: Path) -> list[str]:
    """The files a folder holds, by path relative to it; dot files (an editor's, NFS's) are not the model's."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and not p.name.startswith(".") and p.name != SOURCE_MARKER)


def write_record(folder: Path, name: str, identity: str) -> None:
    files = {f: {"size": (folder / f).stat().st_size, "crc32": checksum(folder / f)} for f in listed(folder)}
    record = {"version": RECORD_VERSION, "name": name, "sha256": identity, "files": files}
    (folder / SOURCE_MARKER).write_text(json.dumps(record, indent=1))


def file_stat(path: Path) -> list[int]:
    """What any write to `path`, or its replacement by another file, changes."""
    s = path.stat()
    return [s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns]


def read_stamp(folder: Path) -> dict:
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def changed_file(folder: Path, sums: dict[str, str]) -> tuple[str, str] | None:
    """The first file whose CRC-32 is not its record's, with the one it has; None when all match. Files the stamp
    names with their present stat and recorded sum are not read; files read and found intact are stamped once
    settled."""
    stamp, stamped = read_stamp(folder), {}
    started = time.time_ns()
    for name, expected in sums.items():
        entry = {"stat": file_stat(folder / name), "crc32": expected}
        if stamp.get(name) != entry:  # else found intact before, and not written since
            crc = checksum(folder / name)
            if crc != expected:
                return name, crc
            if entry["stat"][4] >= started - SETTLED_NS:
                continue  # changed too recently to be stamped
        stamped[name] = entry
    if stamped != stamp:  # unwritten in a read-only cache: its folders are read whole at each start
        write_in_one_step(folder / STAMP, json.dumps(stamped).encode())
    return None


def folder_problem(folder: Path, identity: str) -> str | None:
    """None when `folder` holds what its record says and comes from `identity`; otherwise what is wrong, in a
    few words (an unreadable folder among them: it is prepared again like any damaged one)."""
    try:
        return record_mismatch(folder, identity)
    except OSError as error:  # a permission, an I/O error
        return f"cannot be read ({error.strerror or error})"


def record_mismatch(folder: Path, identity: str) -> str | None:
    """`folder_problem` for a folder that can be read. Sizes are compared first, so most damage is found without
    reading the files."""
    if not folder.is_dir():
        return "is not a folder"
    try:
        record = json.loads((folder / SOURCE_MARKER).read_text())
        if record.get("version") != RECORD_VERSION and "sha256" in record:
            return "was prepared by an earlier version of this program, which kept no record of its files"
        files = record["files"]
        sizes = {f: int(entry["size"]) for f, entry in files.items()}
        sums = {f: str(entry["crc32"]) for f, entry in files.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return "has no readable record of its files"
    if record.get("sha256") != identity:
        return "was prepared from another source file"
    present = listed(folder)
    for name in sizes:
        if name not in present:
            return f"lost {name}"
    for name in present:
        if name not in sizes:
            return f"holds {name}, which it was not prepared with"
    for name, size in sizes.items():
        if (folder / name).stat().st_size != size:
            return f"has {name} at {(folder / name).stat().st_size} bytes, where {size} were written"
    changed = changed_file(folder, sums)
    if changed is not None:
        name, crc = changed
        return f"has {name} changed since it was written (checksum {crc}, not {sums[name]})"
    return None


def sound(folder: Path, identity: str) -> bool:
    """Whether `folder` is there and holds what its record says."""
    return os.path.lexists(folder) and folder_problem(folder, identity) is None


def ready(folder: Path, identity: str, source: str) -> bool:
    """Whether `folder` can be loaded as it is; a damaged one is named in one line before it is prepared again."""
    if not os.path.lexists(folder):
        return False
    problem = folder_problem(folder, identity)
    if problem is None:
        mark_used(folder)
        return True
    print(f"the prepared folder {folder} {problem}; preparing it again from {source}", file=sys.stderr, flush=True)
    return False


def publish_folder(folder: Path, name: str, identity: str, make: Callable[[Path, Path], None],
                   free_space: Callable[[], bool] | None = None) -> Path:
    """Has `make(work, out)` write `out` inside a temporary folder of the cache, records what it holds and where
    it comes from, then moves it to `folder` in one step: the folder appears complete or not at all. Where the disk
    fills, `free_space()` may free some (True where it did) for another try, as long as it frees some."""
    while True:
        try:
            return publish_once(folder, name, identity, make)
        except FullDiskError:  # the work folder is gone already, its partial files with it
            if free_space is None or not free_space():
                raise


def publish_once(folder: Path, name: str, identity: str, make: Callable[[Path, Path], None]) -> Path:
    work = Path(tempfile.mkdtemp(prefix=work_prefix(name), dir=writable_cache_root()))
    try:
        out = work / "converted"
        try:
            make(work, out)
            write_record(out, name, identity)
        except Exception as error:
            remove(work)  # first: what it holds (a whole assembled file) is not what the disk lacks
            full = full_disk(error, work.parent)
            if full is not None:
                raise full from error
            raise
        if os.path.lexists(folder):
            if sound(folder, identity):
                return folder  # another start prepared it meanwhile, and may be reading it: keep theirs
            remove(folder)  # a damaged folder, or an unfinished conversion from an earlier, interrupted run
        try:
            os.replace(out, folder)  # atomic on one filesystem
        except OSError:
            if sound(folder, identity):
                return folder  # another start published it between the check and the rename: theirs is as good
            raise
    finally:
        remove(work)
    return folder
