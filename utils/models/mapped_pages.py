"""Pages of a prepared folder's mapped tensors given back once a kernel has copied them.

`load_native` maps the prepared state (`torch.load(mmap=True)`: one private mapping of the whole file), so the
file's blocks run where they lie. A layer whose kernel repacks its weight (bfloat16 or float32 for oneDNN, float32
copied into `nn.Linear`) reads the mapped bytes once and keeps its own copy; the pages it read stay resident (and
counted in the process's memory) as long as any tensor holds the mapping, which the GGUF blocks beside them do.
A 1.5B IQ3_S file, its layers in bfloat16: 5.75 GB resident warm, twice its weights. `release` drops such pages
(`madvise(MADV_DONTNEED)`): a private mapping of an unchanged file reads them again from the file if touched, so
it is safe even where another tensor still views those bytes. On anonymous memory the same call would zero live
data, so only pages inside the file's own mappings (`file_ranges`, from /proc/self/maps) are ever dropped.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from torch import Tensor


def file_ranges(path: Path) -> list[tuple[int, int]]:
    """[start, end) of each of this process's mappings of the file `path` (none where /proc is not there)."""
    target = os.path.realpath(path)
    ranges = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def byte_range(t: Tensor) -> tuple[int, int]:
    """[first, last + 1) of the bytes `t` views (strided: its span)."""
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def has_bytes(t: Tensor) -> bool:
    """Whether `t` views addressable bytes (oneDNN's packed weights are opaque: memory of their own)."""
    try:
        t.data_ptr()
    except RuntimeError:
        return False
    return t.numel() > 0


def overlaps(t: Tensor, others: Iterable[Tensor]) -> bool:
    lo, hi = byte_range(t)
    return any(byte_range(o)[0] < hi and lo < byte_range(o)[1] for o in others if has_bytes(o))


def release(source: Tensor, kept: Iterable[Tensor], within: list[tuple[int, int]]) -> bool:
    """Drops the whole pages of `source`'s bytes if they lie in one of the file mappings `within` (`file_ranges`),
    unless a tensor of `kept` (what the layer holds) shares them. Whether any were dropped."""
    if sys.platform != "linux" or not hasattr(mmap, "MADV_DONTNEED") or not has_bytes(source):
        return False
    start, end = byte_range(source)
    lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo or not any(first <= lo and hi <= last for first, last in within) or overlaps(source, list(kept)):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED) == 0
