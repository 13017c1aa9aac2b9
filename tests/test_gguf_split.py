"""A GGUF model split into parts by llama.cpp's gguf-split (PREFIX-00001-of-0000N.gguf): given its first part, it
loads at its own precision as the whole file does; a wrong, missing or foreign part is one line."""

import os
import shutil

import pytest
import torch

from gguf_models import write_tiny_gguf
from utils.models.gguf_header import named_parts, split_parts
from utils.models.model_loader import ModelLoadError, load_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("split")
    # the parts hold the tensors in the order written: output.weight is in the first part (test_gguf_config.py
    # has a head in a later part)
    first = write_tiny_gguf(folder / "m.gguf", seed=5, tokenizer=True, split_tensors=10)
    whole = write_tiny_gguf(folder / "whole.gguf", seed=5, tokenizer=True)
    return first, whole


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))


def copy_parts(first, folder):
    folder.mkdir()
    for part in named_parts(first):
        shutil.copy(part, folder / part.name)
    return folder / first.name


def test_the_parts_are_found_by_name_and_header(models):
    first, whole = models
    parts = split_parts(first)
    assert [p.name for p in parts] == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    assert named_parts(first) == parts and split_parts(whole) == named_parts(whole) == [whole]


def test_a_split_model_runs_as_the_whole_file(models, cache):
    first, whole = models
    split_model, split_tokenizer = load_model(str(first), device="cpu", progress=False)
    whole_model, whole_tokenizer = load_model(str(whole), device="cpu", progress=False)
    assert not split_model.config.tie_word_embeddings
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.equal(split_model(ids).logits, whole_model(ids).logits)
    assert split_tokenizer.get_vocab() == whole_tokenizer.get_vocab()
    assert split_tokenizer.chat_template == whole_tokenizer.chat_template


def test_a_changed_part_prepares_the_model_again(models, cache, tmp_path):
    from utils.models.model_loader import file_identity

    first = copy_parts(models[0], tmp_path / "own")
    before = file_identity(first)
    last = named_parts(first)[-1]
    later = last.stat().st_mtime_ns + 10**9  # a second later: timestamps of some file systems are coarse
    os.utime(last, ns=(later, later))
    assert file_identity(first) != before


def test_a_file_replaced_at_its_size_and_time_prepares_again(models, cache, tmp_path):
    """Another fine-tune of the same architecture and quantisation has the same size; a copy that keeps times
    (`cp -p`) can give it the replaced file's modification time too: its own weights must load, not the folder
    prepared from the old file."""
    whole = models[1]
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=6, tokenizer=True)
    assert other.stat().st_size == whole.stat().st_size
    mine = tmp_path / "mine.gguf"
    shutil.copy2(whole, mine)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        before = load_model(str(mine), device="cpu", progress=False)[0](ids).logits
        expected = load_model(str(other), device="cpu", progress=False)[0](ids).logits
        stat = mine.stat()
        shutil.copyfile(other, mine)
        os.utime(mine, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert mine.stat().st_size == stat.st_size and mine.stat().st_mtime_ns == stat.st_mtime_ns
        after = load_model(str(mine), device="cpu", progress=False)[0](ids).logits
    assert not torch.equal(before, expected)
    assert torch.equal(after, expected)


def test_a_later_part_a_missing_part_or_a_foreign_part_is_one_line(models, cache, tmp_path):
    first = copy_parts(models[0], tmp_path / "parts")
    second = named_parts(first)[1]
    with pytest.raises(ModelLoadError, match="part 2 of 3: give the first part, m-00001-of-00003.gguf"):
        load_model(str(second), device="cpu", progress=False)
    # a part of another split in its place
    other = write_tiny_gguf(tmp_path / "o.gguf", seed=6, tokenizer=True, split_tensors=20)  # 2 parts
    shutil.copy(named_parts(other)[1], second)
    with pytest.raises(ModelLoadError, match="m-00002-of-00003.gguf is not part 2 of 3 of the same split "
                                             "\\(it says part 2 of 2\\)"):
        load_model(str(first), device="cpu", progress=False)
    second.unlink()
    with pytest.raises(ModelLoadError, match="part 2 of 3 is missing: no file m-00002-of-00003.gguf beside it"):
        load_model(str(first), device="cpu", progress=False)
    renamed = tmp_path / "parts" / "renamed.gguf"
    shutil.copy(first, renamed)
    with pytest.raises(ModelLoadError, match="not named as gguf-split names them"):
        load_model(str(renamed), device="cpu", progress=False)


def test_a_whole_file_named_like_a_part_is_a_whole_file(models, cache, tmp_path):
    """The name alone makes no split: its header says whether it is one."""
    folder = tmp_path / "named"
    folder.mkdir()
    whole = folder / "w-00001-of-00002.gguf"
    shutil.copy(models[1], whole)
    assert split_parts(whole) == [whole]
    load_model(str(whole), device="cpu", progress=False)


def test_a_split_model_in_float32_asks_for_one_file(models, cache):
    with pytest.raises(ModelLoadError, match="the first of 3 parts: a split GGUF model runs only at its own "
                                             "precision on the CPU"):
        load_model(str(models[0]), device="cpu", dtype="float32", progress=False)


def test_a_damaged_part_is_named(models, cache, tmp_path):
    first = copy_parts(models[0], tmp_path / "damaged")
    third = named_parts(first)[2]
    third.write_bytes(third.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="its part m-00003-of-00003.gguf: ") as error:
        load_model(str(first), device="cpu", progress=False)
    assert "\n" not in str(error.value)



def test_a_first_part_under_another_parts_name_is_named(models, cache, tmp_path):
    """The first part (split.no 0) saved as PREFIX-00002-of-00003.gguf: said as such, not as a model missing its
    tensors."""
    folder = tmp_path / "misnamed"
    folder.mkdir()
    misnamed = folder / "m-00002-of-00003.gguf"
    shutil.copy(named_parts(models[0])[0], misnamed)
    with pytest.raises(ModelLoadError, match="the first part of 3 is named as part 2"):
        load_model(str(misnamed), device="cpu", progress=False)


def test_a_tensor_in_two_parts_is_one_line(cache, tmp_path):
    """A second part of another split of the same model into as many parts (other tensors a part) passes the
    parts' headers, but holds tensors the first part holds too: named, not read twice."""
    first = write_tiny_gguf(tmp_path / "m.gguf", seed=5, tokenizer=True, split_tensors=20)  # 20 + 7 tensors
    other = write_tiny_gguf(tmp_path / "o.gguf", seed=5, tokenizer=True, split_tensors=14)  # 14 + 13
    assert len(named_parts(first)) == len(named_parts(other)) == 2
    shutil.copy(named_parts(other)[1], named_parts(first)[1])
    with pytest.raises(ModelLoadError, match=r"m-00001-of-00002\.gguf is not a readable GGUF file \(tensor \S+ is in "
                                             r"two of its parts\)$"):
        load_model(str(first), device="cpu", progress=False)


def test_only_a_first_parts_name_names_the_parts():
    """A later part's name, or a split into one file, names no other file (a warm start's identity of a user's
    file: a later part given is refused by its header, not read as the whole split)."""
    from pathlib import PurePath

    for name in ("m-00002-of-00003.gguf", "m-00001-of-00001.gguf", "m.gguf", "m-00001-of-00003.bin"):
        assert named_parts(PurePath("d", name)) == [PurePath("d", name)], name
    assert [p.name for p in named_parts(PurePath("d", "M-00001-OF-00002.GGUF"))] == ["M-00001-OF-00002.GGUF",
                                                                                    "M-00002-OF-00002.GGUF"]


def test_a_first_part_named_with_another_count_is_one_line(models, tmp_path):
    """Its header says 3 parts, its name 4: said as a misnamed file, not as a missing fourth part."""
    from utils.models.gguf_header import GGUFHeaderError

    folder = copy_parts(models[0], tmp_path / "count").parent
    renamed = folder / "m-00001-of-00004.gguf"
    shutil.copy(folder / "m-00001-of-00003.gguf", renamed)
    with pytest.raises(GGUFHeaderError, match=r"split into 3 files, but not named as gguf-split names them "
                                              r"\(PREFIX-00001-of-00003.gguf\)"):
        split_parts(renamed)
