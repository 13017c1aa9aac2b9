"""What a start removes from the cache: entries no start has used for `UNUSED_DAYS`.

Each build of the kernels is keyed on its sources, compiler, torch and CPU, and each prepared model folder on the
kernel choice it was prepared for; a change of any (an upgrade, another CPU sharing the folder) makes new ones and
leaves the old behind. Nothing read them again, and they stayed: one development workspace held 28 GB after 21
kernel builds and 9 prepared copies of the 1.5B (1.13 GB each).

A start marks what it uses (`mark_used`: the entry's modification time set to now, as it loads it), and once its
models are loaded removes the entries of the kinds below not marked for `UNUSED_DAYS`, saying so in one line.
A removed entry is only work to redo: a start that needs it again builds or prepares it as on a first start.
Removal is safe under a process still reading an entry (on Linux its open and mapped files live on until closed).
Unknown names are never touched: a cache folder shared with other files keeps them.

A disk that fills while a model is prepared (`freeing_in_turns`) frees more: the entries that this start has not
used, whatever their age; first those this set-up would not load (another kernel build's, another transformers
release's), and only when they free nothing the others, such as the prepared folder of the pair's other model,
which the same start loads next. One development workspace's disk filled within a day of kernel changes, 46.6 GB
of it in the cache's copies that no start would read again.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Callable

from utils.models.cache_folder import STARTED, WORK_NAME, cache_root, remove
from utils.models.prepared_folder import SOURCE_MARKER

UNUSED_DAYS = 30  # long enough for a tool used monthly; an upgrade's leftovers go within a month of it

# A shared cache's server may stamp times a little behind this machine's clock: what was marked in the last minute
# before this start is kept as if this start had marked it.
CLOCK_SLACK_S = 60

KERNEL_BUILD = re.compile(r"qkernels-[0-9a-f]{16}")  # qkernels.ensure's folders
KERNEL_CHOICE = re.compile(r"kernels-[0-9a-f]{12}\.json")  # kernel_choice.KernelChoice's files
DRAFT_CAP = re.compile(r"draft-cap-[0-9a-f]{12}\.json")  # sampling/draft_cap.py's timings


def prunable(entry: Path, assembled: set[str]) -> bool:
    """Whether `entry` is something of ours that a start makes again when it needs it: a prepared model folder (it
    holds our record), a kernel build, a kernel choice, a draft cap's timings, an embedded model's assembled GGUF
    file (named in `assembled`)."""
    if entry.is_symlink():
        return False
    if entry.is_dir():
        return bool(KERNEL_BUILD.fullmatch(entry.name)) or (entry / SOURCE_MARKER).is_file()
    return bool(KERNEL_CHOICE.fullmatch(entry.name) or DRAFT_CAP.fullmatch(entry.name)) or entry.name in assembled


def size_of(entry: Path) -> int:
    if entry.is_file():
        return entry.stat().st_size
    return sum(p.stat().st_size for p in entry.rglob("*") if p.is_file() and not p.is_symlink())


def remove_unused_since(cutoff: float, assembled: set[str], spare: Callable[[str], bool] = lambda name: False
                        ) -> tuple[list[Path], int]:
    """Removes the cache's entries (see `prunable`) last used before `cutoff` (a time.time()), but those whose name
    `spare` names; returns them and the bytes they held."""
    try:
        entries = sorted(cache_root().iterdir())
    except OSError:
        return [], 0
    removed, freed = [], 0
    for entry in entries:
        try:
            # work in progress is the sweep's (a dot name like a prepared folder's for a ".name.gguf" is not)
            if (WORK_NAME.fullmatch(entry.name) or spare(entry.name) or entry.lstat().st_mtime >= cutoff
                    or not prunable(entry, assembled)):
                continue
            size = size_of(entry)
        except OSError:  # gone meanwhile, or unreadable: not ours to judge
            continue
        remove(entry)
        if not entry.exists():
            removed.append(entry)
            freed += size
    return removed, freed


def entries(count: int) -> str:
    return "1 entry" if count == 1 else f"{count} entries"


def prune_unused(assembled: set[str], days: float = UNUSED_DAYS) -> list[Path]:
    """Removes the cache's entries (see `prunable`) not used for `days`; one line says what went. Returns them."""
    removed, freed = remove_unused_since(time.time() - days * 86400, assembled)
    if removed:
        print(f"removed {entries(len(removed))} unused for {days:g} days from the cache {cache_root()} "
              f"({freed / 1e9:.2f} GB; a start that needs one makes it again)", file=sys.stderr, flush=True)
    return removed


def free_for_this_start(assembled: set[str], spare: Callable[[str], bool] = lambda name: False) -> bool:
    """On a full disk: removes the cache's entries (see `prunable`) that this start has not used (last marked before
    it began), whatever their age, but those `spare` names; one line says what went. Whether any did."""
    removed, freed = remove_unused_since(STARTED - CLOCK_SLACK_S, assembled, spare)
    if removed:
        print(f"the disk holding the cache {cache_root()} is full: removed {entries(len(removed))} of it that this "
              f"start does not use ({freed / 1e9:.2f} GB; a start that needs one makes it again), and trying again",
              file=sys.stderr, flush=True)
    return bool(removed)


def freeing_in_turns(assembled: set[str], current: Callable[[str], bool]) -> Callable[[], bool]:
    """A full disk's `free_space` (prepared_folder.publish_folder): each call frees what this start has not used,
    first sparing the `current` entries (prepared for this set-up: a start may load them next), then, once that
    frees nothing more, those too. Whether the call freed any."""
    turns = [current, lambda name: False]

    def free_space() -> bool:
        while turns:
            if free_for_this_start(assembled, turns[0]):
                return True
            turns.pop(0)
        return False

    return free_space
