"""NASD's prior (ngram_assisted/ngram_prior.py): it drafts only where the conversation's storage knows no context,
never changes a greedy answer, and the chat loads, toggles and reports it; the shipped file is the one its build
recorded."""

import gzip
import hashlib
import json

import pytest

from cli_models import tiny_session
from conftest import PROMPT
from ngram_assisted import NGramDraftPolicy, NGramStorage, nasd_run
from ngram_assisted.ngram_assisted import PICKY, WIDE
from ngram_assisted.ngram_cache import NGramCacheError, load_storage, read_state, save_storage, tokenizer_fingerprint
from ngram_assisted import ngram_prior
from sampling import LoopSettings, autoregressive_run
from utils.chat.commands import CommandError, parse_command

GEN = 40
NO_EOS = -1


def test_the_prior_drafts_only_where_the_storage_knows_no_context():
    storage, prior = NGramStorage(4, 64), NGramStorage(4, 64)
    storage.add_sequence([1, 2, 3])  # the storage knows what follows (2,) and (1, 2)
    prior.add_sequence([1, 2, 9, 4, 5])  # the prior disagrees there, and knows what follows 3 and 4
    prior.add_sequence([3, 4])
    assert storage.draft([1, 2], 4) == [3]  # alone: stops where it knows nothing
    assert storage.draft([1, 2], 4, prior=prior) == [3, 4, 5]  # its own 3 first, then the prior's 3 -> 4 -> 5
    assert storage.draft([7], 4, prior=prior) == []  # neither knows 7
    # contexts shorter than the prior's minimum are not read: (3,) is a one-token context
    assert storage.draft([1, 2], 4, prior=prior, prior_min_context=2) == [3]


def test_the_chat_policies_read_the_prior_as_they_read_the_storage():
    assert WIDE.prior_min_context == 1 and PICKY.prior_min_context == 2


@pytest.fixture(scope="module")
def reference(decoder_pairs):
    return autoregressive_run(PROMPT, decoder_pairs["llama"][0], GEN, None, NO_EOS).tokens


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("policy", [PICKY, WIDE, NGramDraftPolicy(stop_if_unknown=False)])
def test_nasd_with_a_prior_equals_autoregressive(decoder_pairs, reference, use_cache, policy):
    """A prior of the right answer is drafted and kept; a prior of a wrong one is drafted and rejected: the tokens
    are AR's either way."""
    target = decoder_pairs["llama"][0]
    vocab = target.config.vocab_size
    answer = PROMPT[-3:] + reference
    right, wrong = NGramStorage(4, vocab), NGramStorage(4, vocab)
    right.add_sequence(answer)
    for i in range(1, len(answer)):  # the same contexts, each followed by another token than the answer's
        wrong.add(answer[max(0, i - 3) : i], [(answer[i] + 1) % vocab])
    loop = LoopSettings(GEN, 4, NO_EOS)
    runs = {name: nasd_run(PROMPT, NGramStorage(4, vocab), target, None, loop, 3, use_cache, policy, prior=prior)
            for name, prior in (("none", None), ("right", right), ("wrong", wrong))}
    for result in runs.values():
        assert result.tokens == reference
    assert runs["right"].accepted > runs["none"].accepted
    assert runs["right"].target_calls < runs["none"].target_calls
    if policy.stop_if_unknown:  # else every round drafts gamma tokens, guessed where nothing is known
        assert runs["wrong"].drafted > runs["none"].drafted


def test_provenance_is_kept_in_the_file_and_ignored_on_loading(tmp_path):
    storage = NGramStorage(4, 64)
    storage.add_sequence([5, 6, 7, 5, 6, 8])
    save_storage(tmp_path / "p.json.gz", storage, "fp", about={"prompts": "x.json"})
    assert read_state(tmp_path / "p.json.gz")["about"] == {"prompts": "x.json"}
    loaded = load_storage(tmp_path / "p.json.gz", "fp", 64)
    assert loaded.counts == storage.counts and loaded.best == storage.best


def test_the_shipped_prior_is_what_its_build_recorded():
    """One file a tokenizer, named after its fingerprint, built from today's prompt file: a changed prompt file
    asks for `python -m benchmarks.ngram_prior build` again."""
    from benchmarks.ngram_prior import PRIOR_PROMPTS, prompts_of

    files = sorted(ngram_prior.PRIORS.glob("*.json.gz"))
    assert files, "no prior shipped"
    held_out = json.loads((PRIOR_PROMPTS.with_name("prompts.json")).read_text())
    assert not {p for ps in held_out.values() for p in ps} & {p for ps in prompts_of(PRIOR_PROMPTS).values() for p in ps}
    for path in files:
        fingerprint = path.name.removesuffix(".json.gz")
        state = read_state(path)
        assert state["tokenizer"] == fingerprint
        assert state["about"]["prompts_sha256"] == hashlib.sha256(PRIOR_PROMPTS.read_bytes()).hexdigest()
        prior = ngram_prior.shipped_prior(fingerprint, state["vocab_size"])
        assert prior is not None and sum(len(c) for c in prior.counts.values()) > 1000
    assert ngram_prior.shipped_prior("0" * 16, 64) is None


def test_a_model_of_the_same_tokenizer_with_a_padded_vocabulary_finds_the_prior(tmp_path, monkeypatch):
    """Models of one tokenizer pad their embeddings to different sizes: the prior's ids fit any of them, while an
    n-gram cache file stays tied to its exact size."""
    monkeypatch.setattr(ngram_prior, "PRIORS", tmp_path)
    storage = NGramStorage(4, 64)
    storage.add_sequence([5, 6, 7, 8])
    save_storage(ngram_prior.prior_path("fp"), storage, "fp")
    assert ngram_prior.shipped_prior("fp", 80).counts == storage.counts
    with pytest.raises(NGramCacheError, match="another tokenizer"):
        ngram_prior.shipped_prior("fp", 60)  # a smaller model: the ids may not exist there
    with pytest.raises(NGramCacheError, match="another tokenizer"):
        load_storage(ngram_prior.prior_path("fp"), "fp", 80)


@pytest.fixture
def session(tmp_path_factory):
    return tiny_session(tmp_path_factory.mktemp("model"), length=6)


def run_command(session, line):
    command, values = parse_command(line)
    return command.run(session, *values)


def test_a_tokenizer_without_a_prior_turns_the_setting_off_and_the_toggle_says_why(session):
    assert session.load_prior() == "" and session.prior is None and not session.settings.ngram_prior
    with pytest.raises(CommandError, match="^/ngram_prior: no usable prior for this tokenizer"):
        run_command(session, "/ngram_prior")
    assert not session.settings.ngram_prior


def ship(session, monkeypatch, folder, prior=None):
    """Ships `prior` (or a damaged file) for the session's tokenizer in `folder`."""
    monkeypatch.setattr(ngram_prior, "PRIORS", folder)
    fingerprint = ngram_prior.prior_fingerprint(session.tokenizer)
    if prior is None:
        data = gzip.compress(b'{"format": "specdec-ngram-cache"}' * 50)
        ngram_prior.prior_path(fingerprint).write_bytes(data[:20] + bytes(b ^ 0x5A for b in data[20:]))
    else:
        save_storage(ngram_prior.prior_path(fingerprint), prior, fingerprint)


def test_the_chat_loads_toggles_and_uses_its_prior(session, monkeypatch, tmp_path):
    vocab = session.target.config.vocab_size
    prior = NGramStorage(4, vocab)
    prior.add_sequence([5, 6, 7, 8])
    ship(session, monkeypatch, tmp_path, prior)
    assert session.load_prior() == "NASD prior: 6 contexts of the target's answers"
    assert session.settings.ngram_prior and session.prior.counts == prior.counts
    seen = []
    monkeypatch.setattr("utils.chat.session.nasd_run", lambda *a, **k: seen.append(k["prior"]))
    session.generate("ngram", [5, 6], [1], None, 4)
    run_command(session, "/ngram_prior")
    assert "ngram prior: off" in session.out.getvalue()
    session.generate("ngram", [5, 6], [1], None, 4)
    assert seen == [session.prior, None]
    run_command(session, "/ngram_prior")
    assert session.settings.ngram_prior


def test_a_prior_not_loaded_at_start_up_is_loaded_by_the_toggle(session, monkeypatch, tmp_path):
    """--no-ngram-prior skips the loading (the tokenizer's fingerprint takes ~0.3 s at 150k tokens)."""
    prior = NGramStorage(4, session.target.config.vocab_size)
    prior.add_sequence([5, 6, 7])
    ship(session, monkeypatch, tmp_path, prior)
    session.settings.ngram_prior = False
    assert session.prior is None
    run_command(session, "/ngram_prior")
    assert session.settings.ngram_prior and session.prior.counts == prior.counts


def test_a_damaged_prior_is_one_line_and_nasd_goes_on_without_it(session, monkeypatch, tmp_path):
    """A valid gzip header before a damaged deflate stream (zlib.error, neither OSError nor EOFError) once ended
    the start-up with a traceback."""
    ship(session, monkeypatch, tmp_path)
    assert session.load_prior() == ""
    assert session.prior is None and not session.settings.ngram_prior
    lines = session.out.getvalue().strip().splitlines()
    assert len(lines) == 1 and "NASD drafts without its prior" in lines[0]


def test_a_session_not_started_by_the_cli_loads_its_prior_before_the_first_answer(session, monkeypatch, tmp_path):
    prior = NGramStorage(4, session.target.config.vocab_size)
    prior.add_sequence([5, 6, 7])
    ship(session, monkeypatch, tmp_path, prior)
    session.settings.enabled = {name: name == "ngram" for name in session.settings.enabled}
    assert session.prior is None and session.settings.ngram_prior
    session.answer("hello")
    assert session.prior.counts == prior.counts


def test_an_ngram_cache_saved_with_the_prior_off_loads_again(session, tmp_path):
    """--no-ngram-prior --ngram-cache FILE once saved a file without its tokenizer's fingerprint, which every
    later start then refused as another tokenizer's."""
    session.settings.ngram_prior = False
    session.use_ngram_cache(str(tmp_path / "c.ngram"))
    session.storage.add_sequence([5, 6, 7])
    session.save_ngram_cache()
    loaded = load_storage(tmp_path / "c.ngram", tokenizer_fingerprint(session.tokenizer), session.target.config.vocab_size)
    assert loaded.counts == session.storage.counts


class Vocabulary:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_the_prior_fingerprint_leaves_out_gguf_padding_entries():
    """A GGUF file's tokenizer pads its vocabulary to the embedding's rows ([PAD151665] ... for Qwen2.5); the
    original has no such entries. The prior is found for both; the n-gram cache file keeps the exact mapping."""
    original = Vocabulary({"a": 0, "b": 1, "<|im_end|>": 2})
    from_gguf = Vocabulary({"a": 0, "b": 1, "<|im_end|>": 2, "[PAD3]": 3, "[PAD4]": 4})
    other = Vocabulary({"a": 0, "c": 1, "<|im_end|>": 2})
    assert ngram_prior.prior_fingerprint(original) == ngram_prior.prior_fingerprint(from_gguf)
    assert ngram_prior.prior_fingerprint(original) != ngram_prior.prior_fingerprint(other)
    assert tokenizer_fingerprint(original) != tokenizer_fingerprint(from_gguf)
