"""A prepared folder's tokenizer, kept pickled beside its files so that a warm start does not build it again.

transformers' Qwen2 tokenizer class reads its tokenizer.json three times in Python on every load (its added
tokens, then vocabulary and merges to rebuild the backend): 1.1-1.3 s a tokenizer on the Zen 3 of
benchmarks/RESULTS.md. Unpickling the built object takes 0.55-0.6 s (the Rust backend parses its JSON once).

The pickle is a dot file, outside the folder's record of its files (`prepared_folder.listed`), named after the
Python, transformers and tokenizers versions that wrote it, with its CRC-32 in front. Any problem reading it (a
version's file missing, damaged bytes, an error while unpickling) means the folder's files are read as before and
the pickle written again. It is trusted as the compiled kernels in the same cache are: whoever can write the cache
can run code.

Within one process, folders whose tokenizer files have the same CRC-32s in their records share one backend: the
second folder's tokenizer is a shallow copy of the first with its own chat template, where the embedded target and
drafter differ (one escaped brace in the tool-call text), instead of a second unpickling.

What the chat derives from a vocabulary at every start (`derived`: the n-gram prior's fingerprint, the drafter
shortlist's tokens and word spellings) is kept the same way, in a second dot file beside the pickle: ~2 s of Python
over 150k tokens a start on the Zen 3 of benchmarks/RESULTS.md, read back in a few milliseconds.
"""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
import sys
import weakref
import zlib
from pathlib import Path

from utils.models.cache_folder import write_in_one_step
from utils.models.prepared_folder import SOURCE_MARKER

PREFIX = ".tokenizer-"
# what a tokenizer's vocabulary and rules are read from; the chat template (chat_template.jinja), weights and
# config.json may differ between models that share them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt")
TEMPLATE_FILE = "chat_template.jinja"
MODEL_FILES = ("config.json", "generation_config.json")  # and weights (WEIGHT_SUFFIXES): no tokenizer reads them
WEIGHT_SUFFIXES = (".pt", ".safetensors", ".bin")
FACTS_PREFIX = ".vocabulary-"
_loaded: dict[tuple, object] = {}  # this process's tokenizers, by files_key
_facts: dict[object, dict] = {}  # what `derived` computed or read in this process, by files_key (else folder)
_origins: dict[int, tuple] = {}  # id(tokenizer) -> (weak reference to it, its folder, its _facts key)


def versions_name(folder: Path, prefix: str) -> Path:
    """`folder`'s dot file of `prefix` for this Python, transformers and tokenizers."""
    import tokenizers
    import transformers

    python = "py{}{}".format(*sys.version_info[:2])
    return folder / f"{prefix}{python}-transformers{transformers.__version__}-tokenizers{tokenizers.__version__}.pickle"


def pickle_path(folder: Path) -> Path:
    return versions_name(folder, PREFIX)


def facts_path(folder: Path) -> Path:
    return versions_name(folder, FACTS_PREFIX)


def read_pickled(path: Path):
    """The tokenizer pickled at `path`, or None where there is none or it does not check out."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    crc, body = data[:8], data[8:]
    if crc != f"{zlib.crc32(body):08x}".encode():
        return None
    try:
        return pickle.loads(body)
    except Exception:  # a class moved or renamed inside the same versions: read the files instead
        return None


def write_pickled(path: Path, tokenizer, prefix: str = PREFIX) -> None:
    """Writes `tokenizer` (or another object) at `path` in one step (a temporary file renamed), removing other
    versions' files of `prefix`. A folder we cannot write (a read-only cache) keeps loading the slow way, silently."""
    try:
        body = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # a tokenizer holding something unpicklable: nothing to keep
        return
    if not write_in_one_step(path, f"{zlib.crc32(body):08x}".encode() + body):
        return
    for old in path.parent.glob(f"{prefix}*.pickle"):
        if old != path:
            old.unlink(missing_ok=True)


def files_key(folder: Path) -> tuple | None:
    """The names and CRC-32s of `folder`'s tokenizer files, from its record (checked against the files when the
    folder was found ready), and whether it has a template file; None without a record, without a tokenizer.json,
    or with a file of unknown part (it might be read by the tokenizer: no sharing then)."""
    try:
        files = json.loads((folder / SOURCE_MARKER).read_text())["files"]
        key = tuple(sorted((name, str(entry["crc32"])) for name, entry in files.items() if name in TOKENIZER_FILES))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    known = (*TOKENIZER_FILES, TEMPLATE_FILE, *MODEL_FILES)
    if "tokenizer.json" not in files or any(n not in known and not n.endswith(WEIGHT_SUFFIXES) for n in files):
        return None
    return (*key, (TEMPLATE_FILE, TEMPLATE_FILE in files))  # without one, the template is tokenizer_config.json's


def with_own_template(tokenizer, folder: Path):
    """A shallow copy of `tokenizer` (the backend shared, never changed by us) named after `folder`, with the chat
    template of `folder`'s file where it has one (where it has none, neither had: the key says so, and the template
    came from the same tokenizer_config.json)."""
    mine = copy.copy(tokenizer)
    template = folder / TEMPLATE_FILE
    if template.is_file():
        mine.chat_template = template.read_text()
    mine.name_or_path = str(folder)
    return mine


def load_tokenizer(folder: Path):
    """The tokenizer of a prepared folder: the one already loaded from the same files in this process, else
    unpickled where a pickle of these versions is there, else read from the folder's files (and pickled for the
    next start)."""
    key = files_key(folder)
    if key in _loaded:
        return remember_origin(with_own_template(_loaded[key], folder), folder, key)
    path = pickle_path(folder)
    tokenizer = read_pickled(path)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        write_pickled(path, tokenizer)
    if key is not None:
        _loaded[key] = tokenizer
    return remember_origin(tokenizer, folder, key)


def remember_origin(tokenizer, folder: Path, key: tuple | None):
    """Notes where `tokenizer` came from, for `derived`; returns it."""
    _origins[id(tokenizer)] = (weakref.ref(tokenizer), folder, key if key is not None else str(folder))
    return tokenizer


def fact_name(fn) -> str:
    """`fn`'s name and a digest of its module's source: an edit of that module computes its facts again (so a fact's
    whole computation belongs in one module)."""
    source = Path(sys.modules[fn.__module__].__file__).read_bytes()
    return f"{fn.__module__}.{fn.__qualname__}:{hashlib.sha1(source).hexdigest()[:12]}"


def derived(tokenizer, fn):
    """`fn(tokenizer)`, for a function of the tokenizer's vocabulary alone (its tokens and ids, not its chat
    template): computed once per process for tokenizers of the same files, and for a prepared folder's tokenizer
    kept in a dot file beside its pickle (`facts_path`), which the next start reads instead. A tokenizer that
    `load_tokenizer` did not give is computed as it is."""
    origin = _origins.get(id(tokenizer))
    if origin is None or origin[0]() is not tokenizer:
        return fn(tokenizer)
    _, folder, key = origin
    name, facts = fact_name(fn), _facts.setdefault(key, {})
    if name not in facts:
        path = facts_path(folder)
        stored = read_pickled(path)
        stored = stored if isinstance(stored, dict) else {}
        if name not in stored:
            function = name.partition(":")[0]  # an older source's value of the same function goes
            stored = {n: v for n, v in stored.items() if n.partition(":")[0] != function}
            stored[name] = fn(tokenizer)
            write_pickled(path, stored, FACTS_PREFIX)
        facts.update(stored)
    return facts[name]
