"""A prepared folder's tokenizer is pickled at its first load and unpickled after (utils/models/tokenizer_cache.py):
the same tokenizer, outside the folder's record, and a damaged or foreign pickle means reading the files again."""

import json

import pytest
import transformers

from gguf_models import write_tiny_gguf
from utils.models import tokenizer_cache
from utils.models.model_loader import gguf_tokenizer
from utils.models.prepared_folder import listed

MESSAGES = [{"role": "user", "content": "def f(x):\n    return x + 1  # ü"}]


@pytest.fixture
def folder(tmp_path):
    path = write_tiny_gguf(tmp_path / "qwen2.gguf", "qwen2", tokenizer=True)
    out = tmp_path / "prepared"
    gguf_tokenizer(path, "qwen2").save_pretrained(out)
    return out


def same(a, b) -> bool:
    text = a.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return (type(a) is type(b) and a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids
            and text == b.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
            and a(text)["input_ids"] == b(text)["input_ids"])


def test_the_second_load_unpickles_the_same_tokenizer(folder, monkeypatch):
    first = tokenizer_cache.load_tokenizer(folder)
    pickled = tokenizer_cache.pickle_path(folder)
    assert pickled.is_file() and pickled.name.startswith(".") and pickled.name not in listed(folder)

    def no_files(*args, **kwargs):
        raise AssertionError("read the folder's files although a pickle was there")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_files)
    assert same(tokenizer_cache.load_tokenizer(folder), first)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "not a pickle"])
def test_a_damaged_pickle_means_the_files_again(folder, damage):
    reference = tokenizer_cache.load_tokenizer(folder)
    pickled = tokenizer_cache.pickle_path(folder)
    data = pickled.read_bytes()
    if damage == "flipped":
        data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:  # a right checksum over bytes that do not unpickle
        import zlib

        data = f"{zlib.crc32(b'junk'):08x}".encode() + b"junk"
    pickled.write_bytes(data)
    assert tokenizer_cache.read_pickled(pickled) is None
    assert same(tokenizer_cache.load_tokenizer(folder), reference)
    assert tokenizer_cache.read_pickled(pickled) is not None  # written again


def test_another_versions_pickle_is_not_read_and_is_replaced(folder, monkeypatch):
    tokenizer_cache.load_tokenizer(folder)
    old = tokenizer_cache.pickle_path(folder)
    monkeypatch.setattr(transformers, "__version__", "0.0.0-other")
    new = tokenizer_cache.pickle_path(folder)
    assert new != old and not new.exists()
    tokenizer_cache.load_tokenizer(folder)
    assert new.is_file() and not old.exists()


def test_a_folder_it_cannot_write_still_loads(folder, monkeypatch):
    import os

    real_open = os.open

    def refuse(path, flags, *args, **kwargs):  # a new file, as `write_in_one_step` makes one: refused
        if flags & os.O_CREAT:
            raise PermissionError(13, "Read-only file system")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    assert tokenizer_cache.load_tokenizer(folder) is not None
    assert not tokenizer_cache.pickle_path(folder).exists()


def test_a_failed_write_leaves_no_temporary_file(folder, monkeypatch):
    import os

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    assert tokenizer_cache.load_tokenizer(folder) is not None
    assert not list(folder.glob(".tmp-*")) and not tokenizer_cache.pickle_path(folder).exists()


def test_folders_with_the_same_tokenizer_files_share_one_backend(tmp_path, monkeypatch):
    """The embedded target and drafter carry the same tokenizer with chat templates one character apart: the
    second load is a copy of the first with its own template (no second unpickling); another tokenizer file, or a
    folder without a record, is loaded on its own."""
    from utils.models.prepared_folder import write_record

    monkeypatch.setattr(tokenizer_cache, "_loaded", {})
    path = write_tiny_gguf(tmp_path / "qwen2.gguf", "qwen2", tokenizer=True)
    folders = [tmp_path / name for name in ("target", "drafter", "other", "unrecorded")]
    for out in folders:
        gguf_tokenizer(path, "qwen2").save_pretrained(out)
        (out / "config.json").write_text(f'{{"name": "{out.name}"}}')  # models differ beside their tokenizer
    template = folders[1] / tokenizer_cache.TEMPLATE_FILE
    template.write_text(template.read_text().replace("assistant", "helper"))
    config = folders[2] / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 77}))
    for out in folders[:3]:
        write_record(out, out.name, "source")
    target = tokenizer_cache.load_tokenizer(folders[0])

    def no_reading(*args, **kwargs):
        raise AssertionError("read a tokenizer again although one of the same files was loaded")

    monkeypatch.setattr(tokenizer_cache, "read_pickled", no_reading)
    drafter = tokenizer_cache.load_tokenizer(folders[1])
    monkeypatch.undo()
    monkeypatch.setattr(tokenizer_cache, "_loaded", {})
    alone = tokenizer_cache.load_tokenizer(folders[1])  # the drafter's folder read by itself
    assert drafter is not target and same(drafter, alone) and not same(drafter, target)
    assert drafter.chat_template == alone.chat_template != target.chat_template
    assert drafter.name_or_path == str(folders[1]) and target.name_or_path == str(folders[0])
    assert same(target, tokenizer_cache.load_tokenizer(folders[0]))  # the copy left the first one as it was
    other, unrecorded = map(tokenizer_cache.load_tokenizer, folders[2:])
    assert other.model_max_length == 77 and target.model_max_length != 77
    assert same(unrecorded, target) and tokenizer_cache.files_key(folders[3]) is None
    with_template = tokenizer_cache.files_key(folders[0])
    (folders[0] / tokenizer_cache.TEMPLATE_FILE).unlink()  # then the template is tokenizer_config.json's: not shared
    write_record(folders[0], "target", "source")
    assert tokenizer_cache.files_key(folders[0]) not in (None, with_template)
    (folders[0] / "extra.json").write_text("{}")  # a file of unknown part: not shared
    write_record(folders[0], "target", "source")
    assert tokenizer_cache.files_key(folders[0]) is None


CALLS = []


def vocabulary_size(tokenizer) -> int:  # a fact for the tests below, counted
    CALLS.append(tokenizer)
    return len(tokenizer.get_vocab())


def fresh_process(monkeypatch) -> None:
    for name in ("_loaded", "_facts", "_origins"):
        monkeypatch.setattr(tokenizer_cache, name, {})


def test_a_fact_of_a_vocabulary_is_computed_once_and_the_next_start_reads_it_back(folder, monkeypatch):
    fresh_process(monkeypatch)
    CALLS.clear()
    tokenizer = tokenizer_cache.load_tokenizer(folder)
    size = tokenizer_cache.derived(tokenizer, vocabulary_size)
    assert size == len(tokenizer.get_vocab()) and len(CALLS) == 1
    assert tokenizer_cache.derived(tokenizer, vocabulary_size) == size and len(CALLS) == 1
    facts = tokenizer_cache.facts_path(folder)
    assert facts.is_file() and facts.name.startswith(".") and facts.name not in listed(folder)
    fresh_process(monkeypatch)  # the next start: the value comes from the file
    assert tokenizer_cache.derived(tokenizer_cache.load_tokenizer(folder), vocabulary_size) == size
    assert len(CALLS) == 1
    # a tokenizer the cache did not give is computed as it is, every time
    loose = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer_cache.derived(loose, vocabulary_size) == size and len(CALLS) == 2
    assert tokenizer_cache.derived(loose, vocabulary_size) == size and len(CALLS) == 3


def test_a_damaged_facts_file_or_an_older_sources_value_is_computed_again(folder, monkeypatch):
    fresh_process(monkeypatch)
    CALLS.clear()
    size = tokenizer_cache.derived(tokenizer_cache.load_tokenizer(folder), vocabulary_size)
    facts = tokenizer_cache.facts_path(folder)
    data = bytearray(facts.read_bytes())
    data[-3] ^= 0xFF
    facts.write_bytes(bytes(data))
    fresh_process(monkeypatch)
    assert tokenizer_cache.derived(tokenizer_cache.load_tokenizer(folder), vocabulary_size) == size
    assert len(CALLS) == 2 and tokenizer_cache.read_pickled(facts) is not None  # written again, whole
    # a value kept under an older source of the same function is not used, and is dropped when written again
    name = tokenizer_cache.fact_name(vocabulary_size)
    old = name.partition(":")[0] + ":000000000000"
    tokenizer_cache.write_pickled(facts, {old: -1}, tokenizer_cache.FACTS_PREFIX)
    fresh_process(monkeypatch)
    assert tokenizer_cache.derived(tokenizer_cache.load_tokenizer(folder), vocabulary_size) == size
    assert len(CALLS) == 3 and tokenizer_cache.read_pickled(facts) == {name: size}


def test_the_chat_s_facts_read_back_equal_the_computed_ones(folder, monkeypatch):
    """The n-gram prior's fingerprint and the shortlist's tokens and spellings, as a warm start reads them."""
    from ngram_assisted.ngram_cache import tokenizer_fingerprint
    from ngram_assisted.ngram_prior import prior_fingerprint
    from utils.models.draft_vocab import spellings_of, vocabulary, word_spellings

    fresh_process(monkeypatch)
    tokenizer_cache.load_tokenizer(folder)
    fresh_process(monkeypatch)
    tokenizer = tokenizer_cache.load_tokenizer(folder)
    loose = transformers.AutoTokenizer.from_pretrained(folder)
    expected = (tokenizer_fingerprint(loose, padding=False), vocabulary(loose), word_spellings(vocabulary(loose)))
    for _ in range(2):  # computed and kept, then read back
        assert (prior_fingerprint(tokenizer), tokenizer_cache.derived(tokenizer, vocabulary),
                tokenizer_cache.derived(tokenizer, spellings_of)) == expected
        fresh_process(monkeypatch)
        tokenizer = tokenizer_cache.load_tokenizer(folder)
