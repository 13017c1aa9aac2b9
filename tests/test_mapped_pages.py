"""A prepared folder's tensors are mapped; a layer that copies its weight gives the pages it read back
(utils/models/mapped_pages.py), and a layer that runs on the mapped bytes keeps them."""

import sys
from pathlib import Path

import pytest
import torch

from gguf_models import write_tiny_gguf
from utils.models import mapped_pages, model_loader, qkernels
from utils.models.kernel_choice import KernelChoice

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc/self/smaps are Linux's")


def resident_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and fields[0][0] in "0123456789abcdef":
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_release_drops_a_mapped_tensors_pages_and_its_values_read_again(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.randn(1024, 1024)}, path)  # 4 MiB
    w = torch.load(path, mmap=True, weights_only=True)["w"]
    expected, within = w.clone(), mapped_pages.file_ranges(path)
    assert resident_bytes(path) > 3 << 20 and within  # read by the clone
    assert not mapped_pages.release(w, [w[5:9]], within)  # a kept view of its bytes: nothing dropped
    assert not mapped_pages.release(expected, [], within)  # not the file's memory: never dropped (it would be zeroed)
    assert torch.equal(expected, w) and resident_bytes(path) > 3 << 20
    assert mapped_pages.release(w, [expected], within)
    assert resident_bytes(path) < 1 << 20
    assert torch.equal(w, expected)  # a private mapping of an unchanged file reads its pages again


@torch.no_grad()
def test_a_prepared_folders_copied_layers_do_not_keep_their_mapped_pages(tmp_path, monkeypatch):
    """Under --kernels f32 every linear layer copies its weight (nn.Linear, or oneDNN's packing): resident, the
    mapped state would hold the weights twice."""
    gguf = write_tiny_gguf(tmp_path / "m.gguf", tokenizer=True)
    folder = tmp_path / "prepared"
    model_loader.prepare_native_folder(gguf, folder, KernelChoice(tmp_path, "f32"), False, False, "m")
    state = folder / model_loader.STATE_FILE
    ids = torch.tensor([[1, 5, 9, 12]])
    released = []
    release = mapped_pages.release
    monkeypatch.setattr(mapped_pages, "release", lambda *args: released.append(release(*args)))
    model, _ = model_loader.load_native(folder)
    logits, dropped = model(ids).logits, resident_bytes(state)
    assert released and all(released)  # every linear layer: 14 in two layers and the head
    assert dropped < state.stat().st_size // 8  # what stays: embedding rows looked up, norms (86 kB of 4.9 MB)
    monkeypatch.setattr(mapped_pages, "release", lambda *args: False)
    kept_model, _ = model_loader.load_native(folder)
    assert torch.equal(kept_model(ids).logits, logits)
    assert resident_bytes(state) > dropped + state.stat().st_size // 2  # both loads map the file: the sum


def test_layers_running_on_the_mapped_blocks_keep_them(tmp_path, monkeypatch):
    assert qkernels.ensure(model_loader.cache_root()), qkernels.why()
    gguf = write_tiny_gguf(tmp_path / "m.gguf", tokenizer=True)
    folder = tmp_path / "prepared"
    model_loader.prepare_native_folder(gguf, folder, KernelChoice(tmp_path, "gguf"), False, False, "m")
    calls = []
    release = mapped_pages.release
    monkeypatch.setattr(mapped_pages, "release", lambda *args: calls.append(release(*args)))
    model_loader.load_native(folder)
    # our kernels read the file's blocks where they lie; only the F16 layers (ffn_up: no integer kernel) may be
    # copied, by bfloat16's oneDNN packing
    assert calls.count(True) <= 2 and calls.count(False) >= 13
