"""Edges of utils/models/tokenizer_cache.py that the main tests leave open (found by a mutation review): which
records allow sharing, facts of folders without a record, stale origins, unpicklable objects, versioned names."""

import json
import weakref

import tokenizers
import transformers

from gguf_models import write_tiny_gguf
from utils.models import tokenizer_cache
from utils.models.model_loader import gguf_tokenizer
from utils.models.prepared_folder import SOURCE_MARKER

CALLS = []


def vocabulary_size(tokenizer) -> int:  # a fact, counted
    CALLS.append(tokenizer)
    return len(tokenizer.get_vocab())


def fresh_process(monkeypatch) -> None:
    for name in ("_loaded", "_facts", "_origins"):
        monkeypatch.setattr(tokenizer_cache, name, {})


def recorded(folder, names) -> None:
    folder.mkdir(exist_ok=True)
    files = {name: {"size": 1, "crc32": f"{i:08x}"} for i, name in enumerate(names)}
    (folder / SOURCE_MARKER).write_text(json.dumps({"files": files}))


def test_a_record_without_tokenizer_json_shares_nothing_and_weights_beside_it_do_not_stop_sharing(tmp_path):
    recorded(tmp_path / "slow", ["vocab.json", "merges.txt", "tokenizer_config.json", "config.json"])
    assert tokenizer_cache.files_key(tmp_path / "slow") is None  # a slow tokenizer's files: not keyed
    recorded(tmp_path / "model", ["tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors",
                                  "extra.bin", "state.pt", tokenizer_cache.TEMPLATE_FILE])
    key = tokenizer_cache.files_key(tmp_path / "model")
    assert key == (("tokenizer.json", "00000000"), ("tokenizer_config.json", "00000001"),
                   (tokenizer_cache.TEMPLATE_FILE, True))  # weights and config: no part of the key


def test_folders_without_a_record_keep_their_own_facts(tmp_path, monkeypatch):
    """Two folders with no record (no files key) and different vocabularies: each its own fact, in this process and
    from its facts file."""
    fresh_process(monkeypatch)
    path = write_tiny_gguf(tmp_path / "qwen2.gguf", "qwen2", tokenizer=True)
    small, large = tmp_path / "small", tmp_path / "large"
    gguf_tokenizer(path, "qwen2").save_pretrained(small)
    bigger = gguf_tokenizer(path, "qwen2")
    bigger.add_tokens(["<specdec-extra-1>", "<specdec-extra-2>"])
    bigger.save_pretrained(large)
    assert tokenizer_cache.files_key(small) is None and tokenizer_cache.files_key(large) is None
    sizes = [tokenizer_cache.derived(tokenizer_cache.load_tokenizer(f), vocabulary_size) for f in (small, large)]
    assert sizes[1] == sizes[0] + 2
    fresh_process(monkeypatch)
    again = [tokenizer_cache.derived(tokenizer_cache.load_tokenizer(f), vocabulary_size) for f in (small, large)]
    assert again == sizes


def test_a_tokenizer_at_the_address_of_a_gone_one_is_computed_as_it_is(tmp_path, monkeypatch):
    """`_origins` is keyed by id(): a new object at a freed tokenizer's address is not that folder's tokenizer
    (the weak reference says so)."""
    fresh_process(monkeypatch)
    CALLS.clear()
    path = write_tiny_gguf(tmp_path / "qwen2.gguf", "qwen2", tokenizer=True)
    gguf_tokenizer(path, "qwen2").save_pretrained(tmp_path / "prepared")
    cached = tokenizer_cache.load_tokenizer(tmp_path / "prepared")
    size = tokenizer_cache.derived(cached, vocabulary_size)
    loose = transformers.AutoTokenizer.from_pretrained(tmp_path / "prepared")
    loose.add_tokens(["<specdec-extra>"])
    # what id() reuse looks like: loose's id noted with a reference to another (the gone) tokenizer
    tokenizer_cache._origins[id(loose)] = (weakref.ref(cached), *tokenizer_cache._origins[id(cached)][1:])
    assert tokenizer_cache.derived(loose, vocabulary_size) == size + 1 and len(CALLS) == 2


def test_an_object_that_does_not_pickle_is_not_kept_and_raises_nothing(tmp_path):
    path = tmp_path / ".tokenizer-x.pickle"
    tokenizer_cache.write_pickled(path, {"fn": lambda: 0})  # pickle refuses a lambda (PicklingError)
    assert not path.exists() and tokenizer_cache.read_pickled(path) is None


def test_the_pickles_name_says_which_versions_wrote_it(tmp_path):
    name = tokenizer_cache.pickle_path(tmp_path).name
    assert name.startswith(tokenizer_cache.PREFIX) and name.endswith(".pickle")
    assert f"transformers{transformers.__version__}" in name and f"tokenizers{tokenizers.__version__}" in name
    facts = tokenizer_cache.facts_path(tmp_path).name
    assert facts == name.replace(tokenizer_cache.PREFIX, tokenizer_cache.FACTS_PREFIX)
