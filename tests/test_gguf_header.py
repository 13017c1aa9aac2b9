"""Hostile and damaged GGUF headers are refused in one line, quickly, before gguf.GGUFReader trusts their counts
(issue 25: an array claiming 2**40 items in a 160-byte file grew the reader to 11 GB)."""

import struct
import subprocess
import sys
import time

import pytest

from gguf_models import write_tiny_gguf
from test_cli import ROOT, env
from utils.models.gguf_header import MAX_ARRAY_ITEMS, walk_header
from utils.models.gguf_native import GGUFFileError, file_tensors


def text(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


def header(kvs: list[bytes], tensors: list[bytes] = (), version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)


ARCH = text(b"general.architecture") + struct.pack("<I", 8) + text(b"qwen2")


def array(key: bytes, item_type: int, count: int, payload: bytes = b"") -> bytes:
    return text(key) + struct.pack("<II", 9, item_type) + struct.pack("<Q", count) + payload


def tensor(name: bytes, dims: list[int], type_id: int = 0, offset: int = 0) -> bytes:
    return text(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", type_id, offset)


HOSTILE = {
    "issue's array of 2**40 bytes": (header([ARCH, array(b"x.y", 0, 2**40)]) + bytes(64), "needs 1099511627776 bytes"),
    "architecture string of 2**50 bytes": (header([text(b"general.architecture") + struct.pack("<I", 8)
                                                   + struct.pack("<Q", 2**50)]) + bytes(64), "1125899906842624 bytes long"),
    "array of 2**40 strings": (header([ARCH, array(b"tokens", 8, 2**40)]) + bytes(64), "needs 8796093022208 bytes"),
    "array of arrays": (header([ARCH, array(b"nested", 9, 2**40)]) + bytes(64), "needs 13194139533312 bytes"),
    "2**60 metadata entries": (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**60) + bytes(64), "metadata entries"),
    "2**60 tensors": (b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0) + bytes(64), "tensor descriptions"),
    "unknown value type": (header([text(b"k") + struct.pack("<I", 77) + bytes(8)]), "unknown value type 77"),
    "2**32-1 dimensions": (header([ARCH], [text(b"t") + struct.pack("<I", 2**32 - 1) + bytes(64)]), "4294967295 dimensions"),
    "tensor past the end": (header([ARCH], [tensor(b"t", [2**31, 2**31])]) + bytes(64), "tensor t ends at byte"),
    "unknown tensor type": (header([ARCH], [tensor(b"t", [4], type_id=999)]) + bytes(64), "unknown type 999"),
    "too many array items": (header([ARCH, array(b"big", 0, MAX_ARRAY_ITEMS + 1, bytes(MAX_ARRAY_ITEMS + 1))]),
                             f"more than the {MAX_ARRAY_ITEMS} this program reads"),
    "truncated key": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 40) + b"abc" + bytes(10),
                      "40 bytes long"),
    "version 1": (header([ARCH], version=1) + bytes(8), "GGUF version 1"),
    # bytes flipped in a key: transformers' metadata reader then stopped at a bare UnicodeDecodeError
    "a key not UTF-8": (header([text(b"general.arch\xff\xfeture") + struct.pack("<I", 8) + text(b"qwen2")]),
                        "the name of metadata entry 0 at offset 24 is not UTF-8"),
    "a key of 70000 bytes": (header([text(b"k" * 70000) + struct.pack("<I", 4) + bytes(4)]),
                             "the name of metadata entry 0 is 70000 bytes long"),
    # the specification's limit itself: one byte over it is refused
    "a key of 65536 bytes": (header([text(b"k" * 65536) + struct.pack("<I", 4) + bytes(4)]),
                             "the name of metadata entry 0 is 65536 bytes long"),
    "too short": (b"GGUF\x03\x00", "too short"),
    # mutation review: each of these checks could go without a test failing
    "alignment 0": (header([ARCH, text(b"general.alignment") + struct.pack("<II", 4, 0)]),
                    "alignment 0 is not a power of two"),
    "alignment 48": (header([ARCH, text(b"general.alignment") + struct.pack("<II", 4, 48)]),
                     "alignment 48 is not a power of two"),
    "a tensor of no dimension": (header([ARCH], [text(b"t") + struct.pack("<I", 0) + struct.pack("<IQ", 0, 0)])
                                 + bytes(64), "tensor t has 0 dimensions"),
    "rows not whole blocks": (header([ARCH], [tensor(b"t", [100], type_id=12)]) + bytes(256),  # 12: Q4_K
                              "tensor t's rows of 100 are not whole blocks of 256"),
    "arrays nested 3000 deep": (header([text(b"n") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 3000
                                        + struct.pack("<IQ", 0, 0)]), "nests arrays more than 8 deep"),
    # a vocabulary string cut short: named as the item it is, not as a count read past the end after it
    "a string item past the end": (header([ARCH, array(b"tokens", 8, 2, text(b"ab") + struct.pack("<Q", 100) + b"xy")]),
                                   "metadata tokens[1] (100 bytes long) needs 100 bytes"),
    "alignment as a string": (header([ARCH, text(b"general.alignment") + struct.pack("<I", 8) + text(b"64")]),
                              "general.alignment has value type 8, not uint32 (4)"),
    "a tensor named twice": (header([ARCH], [tensor(b"t", [8]), tensor(b"t", [8], offset=32)]) + bytes(128),
                             "tensor t appears twice"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_headers_are_refused_quickly_in_one_line(tmp_path, case):
    data, message = HOSTILE[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    start = time.perf_counter()
    with pytest.raises(GGUFFileError) as error:
        file_tensors(path)
    assert time.perf_counter() - start < 5  # the reader alone loops for ever on the first three cases
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith(f"{path} is not a readable GGUF file (")  # its full path, not its bare name


def test_a_valid_file_passes_and_reads_as_before(tmp_path):
    path = write_tiny_gguf(tmp_path / "ok.gguf")
    walk_header(path)
    assert len(file_tensors(path)) == 2 * 12 + 3  # per layer 7 weights, 2 norms, 3 biases; embeddings, head, norm


def test_the_checked_table_reads_each_tensor_as_the_reader_does(tmp_path):
    import gguf
    import numpy as np

    from utils.models.gguf_header import read_tensors

    path = write_tiny_gguf(tmp_path / "ok.gguf")
    ours, theirs = read_tensors(path), gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs):
        assert a.tensor_type == b.tensor_type and list(a.shape) == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_the_cli_refuses_the_issues_file_in_one_line(tmp_path, dtype):
    """Both paths read the header first: native preparation and transformers' own GGUF loader (float32)."""
    path = tmp_path / "b.gguf"
    path.write_bytes(HOSTILE["issue's array of 2**40 bytes"][0])
    argv = [sys.executable, "infer.py", "--target", str(path), "--drafter", str(path), "--dtype", dtype,
            "--device", "cpu", "--prompt", "hi"]
    done = subprocess.run(argv, cwd=ROOT, env=env(SPECDEC_CACHE_DIR=str(tmp_path / "cache")), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    *before, last = done.stderr.strip().splitlines()
    assert last.startswith(f"{path} is not a readable GGUF file (") and "needs 1099511627776 bytes" in last
    assert all(line.endswith("(one time only)…") for line in before)  # a first start's kernel build, if any
    assert "preparing" not in done.stderr  # refused before anything is prepared


def test_every_cut_of_a_valid_file_is_refused_in_one_line(tmp_path):
    """A download or copy cut short: at every byte of the header, and one byte short of each tensor's end, the
    file is refused as not readable in one line (not a struct.error or a numpy reshape error from the reader)."""
    whole_path = write_tiny_gguf(tmp_path / "ok.gguf", tokenizer=True)
    whole = whole_path.read_bytes()
    walker = walk_header(whole_path)
    ends = sorted({walker.data_start + offset + nbytes for *_, offset, nbytes in walker.tensors})
    assert ends[-1] == len(whole)
    path = tmp_path / "cut.gguf"
    for cut in [*range(walker.data_start + 1), *(end - 1 for end in ends)]:
        path.write_bytes(whole[:cut])
        with pytest.raises(GGUFFileError) as error:
            file_tensors(path)
        assert str(error.value).startswith(f"{path} is not a readable GGUF file (") and "\n" not in str(error.value)


def test_a_files_own_alignment_places_its_tensors(tmp_path):
    """general.alignment moves where the tensor data begins: read at the default 32, every tensor is shifted."""
    import gguf
    import numpy as np

    from utils.models.gguf_header import read_tensors

    path = tmp_path / "aligned.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_custom_alignment(256)
    values = {"a": np.arange(8, dtype=np.float32), "b": np.arange(100, 116, dtype=np.float32)}
    for name, data in values.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    walker = walk_header(path)
    assert walker.data_start % 256 == 0 and walker.data_start != -(-walker.pos // 32) * 32  # the file tells apart
    tensors = read_tensors(path)
    assert {t.name: t.data.tolist() for t in tensors} == {name: data.tolist() for name, data in values.items()}


def test_a_big_endian_file_is_walked_in_its_own_byte_order(tmp_path):
    """A file written on a big-endian machine: every count read in the wrong order is a huge claim, so the walk
    must detect the order from the version (as the reader does), then leave the tensors to the reader."""
    import gguf
    import numpy as np

    from utils.models.gguf_header import read_tensors

    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2", endianess=gguf.GGUFEndian.BIG)
    writer.add_block_count(3)
    writer.add_token_list(["a", "bb", "ccc"])  # strings: their lengths in the file's order too
    writer.add_token_types([1, 1, 3])
    writer.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    walker = walk_header(path)
    assert walker.order == ">" and walker.scalars["qwen2.block_count"] == 3
    assert [(name, shape, type_id) for name, shape, type_id, *_ in walker.tensors] == [("t", [32, 2], 0)]
    assert read_tensors(path) is None  # the reader byte-swaps; the checked table does not


def nested(levels: int) -> bytes:
    """A metadata entry holding `levels` arrays, each the only item of the one outside it."""
    return text(b"n") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * (levels - 1) + struct.pack("<IQ", 0, 0)


def test_arrays_nest_eight_deep_and_no_deeper(tmp_path):
    """The limit's message says 8 levels: a file at the limit is read, one level more is refused."""
    path = tmp_path / "nested.gguf"
    path.write_bytes(header([ARCH, nested(8)]))
    assert walk_header(path).keys == {"general.architecture", "n"}
    path.write_bytes(header([ARCH, nested(9)]) + b" ")  # another size: not the walk cached above
    with pytest.raises(ValueError, match="nests arrays more than 8 deep"):
        walk_header(path)


def test_a_tensor_of_four_dimensions_and_one_of_odd_bytes_are_read(tmp_path):
    """GGUF tensors have up to four dimensions (GGML_MAX_DIMS): the fourth is no damage; an int8 tensor's size is
    its count of values, odd or not."""
    import gguf
    import numpy as np

    from utils.models.gguf_header import read_tensors

    path = tmp_path / "4d.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    values = np.arange(2 * 3 * 1 * 32, dtype=np.float32).reshape(2, 3, 1, 32)
    odd = np.arange(33, dtype=np.int8)
    writer.add_tensor("t", values)
    writer.add_tensor("odd", odd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor, small = read_tensors(path)
    assert tensor.shape == (32, 1, 3, 2) and np.array_equal(tensor.data, values)
    assert small.shape == (33,) and np.array_equal(small.data, odd)

