"""Edges of utils/models/mapped_pages.py (found by a mutation review): only whole pages inside the source's own
bytes are dropped, never a neighbour's page, and what `release` says it dropped it did drop."""

import mmap
import os
import sys

import pytest
import torch

from utils.models import mapped_pages

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc/self/maps are Linux's")
PAGE = mmap.PAGESIZE
COLUMNS = PAGE // 4  # a float32 row of one page


@pytest.fixture
def mapped(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.arange(64 * COLUMNS, dtype=torch.float32).reshape(64, COLUMNS)}, path)
    w = torch.load(path, mmap=True, weights_only=True)["w"]  # a private mapping: writes stay in this process
    return path, w, mapped_pages.file_ranges(path)


def test_byte_range_is_the_span_a_strided_view_reads():
    t = torch.zeros(5, 7)
    view = t[1:4, 2:5]  # rows 1..3, columns 2..4: from element 9 to element 25, inclusive
    start = t.data_ptr() + 9 * 4
    assert mapped_pages.byte_range(view) == (start, start + 17 * 4)
    assert mapped_pages.byte_range(t[2]) == (t.data_ptr() + 14 * 4, t.data_ptr() + 21 * 4)


def test_only_whole_pages_inside_the_source_are_dropped_not_a_modified_neighbours(mapped):
    """The neighbours just before and just after a source that neither starts nor ends on a page boundary were
    changed in this process (their pages copied on write): dropping their page would undo that."""
    _, w, within = mapped
    flat = w.view(-1)
    first = (-flat.data_ptr() % PAGE) // 4 + COLUMNS  # the first element of a page inside the mapping
    source = flat[first + 1:first + 5 * COLUMNS - 1]  # one element past a boundary to one short of another
    start, end = mapped_pages.byte_range(source)
    assert start % PAGE and end % PAGE and (end - start) // PAGE == 4  # edges mid-page: three whole pages inside
    flat[first] = -1.0  # the element before the source's first byte
    flat[first + 5 * COLUMNS - 1] = -2.0  # the element at its end (the byte after its last)
    expected = source.clone()
    assert mapped_pages.release(source, [], within)
    assert (flat[first].item(), flat[first + 5 * COLUMNS - 1].item()) == (-1.0, -2.0)
    assert torch.equal(source, expected)


def test_a_source_smaller_than_a_page_drops_nothing_and_says_so(mapped):
    _, w, within = mapped
    flat = w.view(-1)
    boundary = (-flat.data_ptr() % PAGE) // 4 + COLUMNS  # the first element of a page
    assert not mapped_pages.release(flat[boundary - 5:boundary + 5], [], within)  # across a boundary: no whole page
    assert not mapped_pages.release(w[3, 5:20], [], within)


def test_kept_tensors_beside_the_source_do_not_stop_a_release(mapped):
    _, w, within = mapped
    flat = w.view(-1)
    source = w[4:12]
    assert mapped_pages.release(source, [w[3], w[12]], within)  # the rows just before and after it
    assert not mapped_pages.release(w[4:12], [flat[12 * COLUMNS - 1:12 * COLUMNS + 1]], within)  # shares a byte


def test_a_file_mapped_through_a_link_is_found_by_the_link(mapped, tmp_path):
    path, _, within = mapped
    link = tmp_path / "link.pt"
    os.symlink(path, link)
    assert within and mapped_pages.file_ranges(link) == within
