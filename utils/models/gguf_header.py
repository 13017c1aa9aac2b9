"""Checks a GGUF file's header against the file's size before the `gguf` package reads it.

`gguf.GGUFReader` trusts every count in the header: it loops once per claimed array item, appending a view per
item, and a view past the end of the file is simply empty, so an array claiming 2**40 items in a 160-byte file
loops 2**40 times while memory grows without bound. This walk reads the same layout with every count and length
checked against the bytes that are left, so a damaged or hostile file is refused in one line, quickly, in
constant memory; it keeps nothing it reads but the alignment and the tensor table.

`read_tensors` returns that table as the reader's tensors (name, type, shape, a numpy view of the data) without
the reader's parse of the metadata values, which builds numpy views per vocabulary string: ~6 s a file for the
embedded pair, paid at every preparation on top of transformers' own parses of the same file.
"""

from __future__ import annotations

import hashlib
import mmap
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePath

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what gguf.GGUFReader reads
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
STRING, ARRAY, UINT32 = 8, 9, 4
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays: the reader recurses once per level
# The reader keeps a few hundred bytes of numpy views per array item, so the items must be bounded, not only the
# bytes: 2**22 is over five times the largest real vocabulary's tokens, scores and types together (262k each).
MAX_ARRAY_ITEMS = 1 << 22
DEFAULT_ALIGNMENT = 32
TENSOR_INFO_MIN = 8 + 4 + 4 + 8  # an empty name, no dimension, type, offset
KV_MIN = 8 + 4 + 1  # an empty key, type, the smallest value
MAX_KEY = 65535  # bytes of a metadata key (GGUF's specification)


class GGUFHeaderError(ValueError):
    """The header contradicts itself or the file's size; the message is one line naming where."""


def tokenizer_facts(path: Path) -> tuple[str, str | None]:
    """A digest of what the file's tokenizer is made from (every `tokenizer.` key but the chat template, and
    `general.architecture`), and its chat template (None where it has none). Two files of one model family (the
    embedded target and drafter) share the digest and differ in their templates."""
    walker = walk_header(path)  # checked first: a file too short to map is refused here
    digest, template = hashlib.sha256(), None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for key in sorted(walker.spans):
            value_type, start, end = walker.spans[key]
            if key == CHAT_TEMPLATE and value_type == STRING:  # its 8-byte length, then the text
                template = bytes(data[start + 8 : end]).decode("utf-8", "replace")
            elif key.startswith("tokenizer.") or key == "general.architecture":
                digest.update(f"{key}:{value_type}:{end - start}:".encode())
                digest.update(data[start:end])
    return digest.hexdigest(), template


CHAT_TEMPLATE = "tokenizer.chat_template"

# llama.cpp's gguf-split: a model in N parts named PREFIX-00001-of-0000N.gguf; every part says its number (from 0)
# and the count, the first holds the metadata, the tensors are spread over all.
SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})(?P<of>-of-)(?P<count>\d{5})(?P<suffix>\.gguf)", re.IGNORECASE)
SPLIT_NO, SPLIT_COUNT = "split.no", "split.count"


def named_parts(path: PurePath) -> list[PurePath]:
    """The part files a split model's first part names, by name alone (no file read: a warm start's identity of a
    user's file; a file's path on the hub); [path] for any other name."""
    match = SPLIT_NAME.fullmatch(path.name)
    if match is None or int(match["no"]) != 1 or int(match["count"]) <= 1:
        return [path]
    return [path.with_name(f"{match['prefix']}-{no:05d}{match['of']}{match['count']}{match['suffix']}")
            for no in range(1, int(match["count"]) + 1)]


def split_parts(path: Path) -> list[Path]:
    """The files of the GGUF model `path` names: [path] for a whole file, every part for the first part of a
    split one, each header checked (GGUFHeaderError naming what is wrong: a later part given, a part missing or
    from another split)."""
    first = walk_header(path)
    count = first.scalars.get(SPLIT_COUNT, 1)
    if count <= 1:
        return [path]
    match = SPLIT_NAME.fullmatch(path.name)
    if match is None or int(match["count"]) != count:
        raise GGUFHeaderError(f"part of a model split into {count} files, but not named as gguf-split names them "
                              f"(PREFIX-00001-of-{count:05d}.gguf)")
    if first.scalars.get(SPLIT_NO, 0) != 0:
        raise GGUFHeaderError(f"part {first.scalars[SPLIT_NO] + 1} of {count}: give the first part, "
                              f"{match['prefix']}-00001-of-{count:05d}.gguf")
    if int(match["no"]) != 1:
        raise GGUFHeaderError(f"the first part of {count} is named as part {int(match['no'])}")
    parts = named_parts(path)
    for no, part in enumerate(parts[1:], start=1):
        if not part.is_file():
            raise GGUFHeaderError(f"part {no + 1} of {count} is missing: no file {part.name} beside it")
        try:
            scalars = walk_header(part).scalars
        except GGUFHeaderError as error:
            raise GGUFHeaderError(f"its part {part.name}: {error}") from None
        if (scalars.get(SPLIT_NO), scalars.get(SPLIT_COUNT)) != (no, count):
            raise GGUFHeaderError(f"{part.name} is not part {no + 1} of {count} of the same split (it says part "
                                  f"{scalars.get(SPLIT_NO, 0) + 1} of {scalars.get(SPLIT_COUNT, 1)})")
    return parts


def walk_header(path: Path) -> "Walker":
    """The walk of the whole header of the GGUF file at `path`: GGUFHeaderError at the first claim the file cannot
    hold; it maps the file and touches only its first pages. Done once per version of the file in a process:
    preparing a model asks of one header several times (its checks, its parts, its config, its tensors, its
    tokenizer), and a walk over a 150k-token vocabulary takes 0.13 s on the Zen 3 of benchmarks/RESULTS.md."""
    stat = path.stat()
    if stat.st_size < 4 + 4 + 8 + 8:
        raise GGUFHeaderError(f"{stat.st_size} bytes, too short for a GGUF header")
    return walked(str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)


@lru_cache(maxsize=16)
def walked(path: str, size: int, mtime_ns: int, inode: int) -> "Walker":
    """`walk_header` for one version of a file (its size, time and inode are the key); a refusal is not kept."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        walker = Walker(data)
        walker.walk()
    walker.data = None  # the map closes here; what the walk read is kept in the walker's fields
    return walker


@dataclass(frozen=True)
class FileTensor:
    """A tensor as gguf.GGUFReader's `tensors` describe it."""
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # the file's order: the row length first
    data: np.ndarray  # [rows..., row bytes] uint8 for block types, the values for plain ones; read-only


# plain GGML types -> numpy item types, as the reader maps them; every other type is read as its bytes
PLAIN_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


def read_tensors(path: Path) -> list[FileTensor] | None:
    """The file's tensors, its header checked as `walk_header` does; None for a big-endian file (the reader
    converts those)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    walker = walk_header(path)
    if walker.order != "<":
        return None
    file = np.memmap(path, dtype=np.uint8, mode="r")
    tensors, names = [], set()
    for name, shape, type_id, offset, nbytes in walker.tensors:
        if name in names:
            raise GGUFHeaderError(f"tensor {name} appears twice")
        names.add(name)
        kind = GGMLQuantizationType(type_id)
        dims = tuple(reversed(shape))
        start = walker.data_start + offset
        raw = file[start : start + nbytes]
        if type_id in PLAIN_TYPES:
            data = raw.view(PLAIN_TYPES[type_id]).reshape(dims)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(dims, kind))
        tensors.append(FileTensor(name, kind, tuple(shape), data))
    return tensors


@lru_cache(maxsize=1)
def tensor_sizes() -> dict[int, tuple[int, int]]:
    from gguf.constants import GGML_QUANT_SIZES

    return {int(qtype): sizes for qtype, sizes in GGML_QUANT_SIZES.items()}


class Walker:
    def __init__(self, data):
        self.data, self.pos, self.order = data, 0, "<"
        self.array_items = 0
        self.keys: set[str] = set()  # the metadata keys walked
        self.spans: dict[str, tuple[int, int, int]] = {}  # key -> (value type, first byte of its value, end)
        self.scalars: dict[str, int] = {}  # key -> value, for integer (and boolean) values: their bits, unsigned
        self.texts: dict[str, str] = {}  # key -> the first 80 bytes of a string value

    def left(self) -> int:
        return len(self.data) - self.pos

    def need(self, count: int, what: str) -> None:
        if count > self.left():
            raise GGUFHeaderError(f"{what} needs {count} bytes at offset {self.pos}, but only {self.left()} are left")

    def uint(self, size: int, what: str) -> int:
        self.need(size, what)
        value = struct.unpack_from(self.order + {1: "B", 2: "H", 4: "I", 8: "Q"}[size], self.data, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str, limit: int | None = 80) -> str:
        """The string at the position; only its first `limit` bytes unless None (a tensor's name is kept whole)."""
        length = self.uint(8, what)
        self.need(length, f"{what} ({length} bytes long)")
        end = self.pos + (length if limit is None else min(length, limit))
        text = bytes(self.data[self.pos : end]).decode("utf-8", "replace")
        self.pos += length
        return text

    def key(self, index: int) -> str:
        """A metadata key: GGUF's are ASCII; one that is not even UTF-8 is damage (transformers' reader would stop
        at it with a UnicodeDecodeError)."""
        start = self.pos
        key = self.string(f"the name of metadata entry {index}")
        length = self.pos - start - 8
        if length > MAX_KEY:
            raise GGUFHeaderError(f"the name of metadata entry {index} is {length} bytes long")
        try:
            bytes(self.data[start + 8 : self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFHeaderError(f"the name of metadata entry {index} at offset {start} is not UTF-8") from None
        return key

    def walk(self) -> None:
        if bytes(self.data[:4]) != MAGIC:
            raise GGUFHeaderError("no GGUF magic at its start")
        self.pos = 4
        version = self.uint(4, "the version")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order, as the reader detects it
            self.order, self.pos = ">", 4
            version = self.uint(4, "the version")
        if version not in VERSIONS:
            raise GGUFHeaderError(f"GGUF version {version}; versions {' and '.join(map(str, VERSIONS))} are read")
        tensors, kvs = self.uint(8, "the tensor count"), self.uint(8, "the metadata count")
        self.need(kvs * KV_MIN, f"{kvs} metadata entries")
        alignment = DEFAULT_ALIGNMENT
        for index in range(kvs):
            key = self.key(index)
            value_type = self.uint(4, f"the type of metadata {key}")
            start = self.pos
            value = self.value(value_type, f"metadata {key}", 0)
            self.keys.add(key)
            self.spans[key] = (value_type, start, self.pos)
            if value_type in SCALAR_SIZES:
                self.scalars[key] = value
            elif value_type == STRING:
                self.texts[key] = value
            if key == "general.alignment":
                if value_type != UINT32:  # gguf's reader refuses it too: at the default, every offset would be off
                    raise GGUFHeaderError(f"general.alignment has value type {value_type}, not uint32 ({UINT32})")
                alignment = value
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFHeaderError(f"alignment {alignment} is not a power of two")
        self.need(tensors * TENSOR_INFO_MIN, f"{tensors} tensor descriptions")
        self.tensors = [self.tensor_info(index) for index in range(tensors)]
        self.data_start = data_start = -(-self.pos // alignment) * alignment
        for name, _, _, offset, nbytes in self.tensors:
            end = data_start + offset + nbytes
            if end > len(self.data):
                raise GGUFHeaderError(f"tensor {name} ends at byte {end}, past the file's end at {len(self.data)}")

    def value(self, value_type: int, what: str, depth: int):
        if value_type in SCALAR_SIZES:
            return self.uint(SCALAR_SIZES[value_type], what)
        if value_type == STRING:
            return self.string(what)
        if value_type != ARRAY:
            raise GGUFHeaderError(f"{what} has unknown value type {value_type}")
        if depth >= MAX_NESTING:
            raise GGUFHeaderError(f"{what} nests arrays more than {MAX_NESTING} deep")
        item_type, count = self.uint(4, f"the item type of {what}"), self.uint(8, f"the length of {what}")
        smallest = SCALAR_SIZES.get(item_type, 8 if item_type == STRING else 12)  # a string's length; an array's
        self.need(count * smallest, f"{what} ({count} items)")
        self.array_items += count
        if self.array_items > MAX_ARRAY_ITEMS:
            raise GGUFHeaderError(f"{what} brings the metadata arrays to {self.array_items} items, more than the "
                                  f"{MAX_ARRAY_ITEMS} this program reads")
        if item_type in SCALAR_SIZES:  # fixed-size items: checked above, skipped without a loop
            self.pos += count * smallest
            return None
        if item_type == STRING:
            self.skip_strings(count, what)
            return None
        for index in range(count):
            self.value(item_type, f"{what}[{index}]", depth + 1)
        return None

    def skip_strings(self, count: int, what: str) -> None:
        """The vocabulary's 150k strings: one unpack each, no message built unless one is wrong."""
        length_of, data, pos, end = struct.Struct(self.order + "Q").unpack_from, self.data, self.pos, len(self.data)
        for index in range(count):
            if pos + 8 > end or pos + 8 + length_of(data, pos)[0] > end:
                self.pos = pos
                self.string(f"{what}[{index}]")  # raises, naming the item
            pos += 8 + length_of(data, pos)[0]
        self.pos = pos

    def tensor_info(self, index: int) -> tuple[str, list[int], int, int, int]:
        """(name, shape, type, offset, bytes) of tensor `index`."""
        name = self.string(f"the name of tensor {index}", limit=None)
        dims = self.uint(4, f"the dimension count of tensor {name}")
        if not 1 <= dims <= MAX_DIMS:
            raise GGUFHeaderError(f"tensor {name} has {dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
        shape = [self.uint(8, f"the shape of tensor {name}") for _ in range(dims)]
        type_id = self.uint(4, f"the type of tensor {name}")
        offset = self.uint(8, f"the data offset of tensor {name}")
        sizes = tensor_sizes()
        if type_id not in sizes:
            raise GGUFHeaderError(f"tensor {name} has unknown type {type_id}")
        block, block_bytes = sizes[type_id]
        if shape[0] % block:
            raise GGUFHeaderError(f"tensor {name}'s rows of {shape[0]} are not whole blocks of {block}")
        elements = 1
        for extent in shape:
            elements *= extent  # Python integers: a hostile shape cannot overflow into a small size
        return name, shape, type_id, offset, elements // block * block_bytes
