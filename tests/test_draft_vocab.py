"""The drafter's shortlist head (`--draft-vocab`, utils/models/draft_vocab.py): the listed tokens' logits as the
full head gives them, -inf elsewhere, the conversation's tokens added; greedy speculative decoding with it still
gives AR's tokens (its sampled distribution: tests/test_distribution.py)."""

import copy

import pytest
import torch

from conftest import PROMPT, tiny_decoder
from sampling import autoregressive_generate, speculative_generate
from utils.models import draft_vocab, qkernels
from utils.models.draft_vocab import ShortlistHead, tokenizer_fingerprint, use_draft_vocab, vocabulary, word_spellings
from utils.models.model_loader import cache_root
from utils.models.native_linear import GGUFLinear, requantize_q4_1

HIDDEN, VOCAB = 64, 96


@torch.no_grad()
def check_head(full: torch.nn.Module, ids: list[int], exact: bool, hidden: int = HIDDEN) -> None:
    """exact: our kernels give a row the same bits whatever the other rows; a float matmul over fewer output rows
    may take another kernel, equal to rounding."""
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    head = ShortlistHead(full, torch.tensor(ids), VOCAB)
    x = torch.randn(3, hidden)
    want = full(x)  # [3, vocab]
    got = head(x)
    listed = torch.zeros(VOCAB, dtype=torch.bool)
    listed[ids] = True
    assert same(got[:, listed], want[:, listed])
    assert torch.isneginf(got[:, ~listed]).all()
    head.include(torch.tensor([[90, 91, ids[0], 90]]))  # new ones once, listed ones ignored
    assert head.extra_ids.tolist() == [90, 91]
    got = head(x)
    listed[[90, 91]] = True
    assert same(got[:, listed], want[:, listed])
    assert torch.isneginf(got[:, ~listed]).sum() == 3 * (VOCAB - len(ids) - 2)


def test_shortlist_head_of_a_linear_layer():
    torch.manual_seed(0)
    check_head(torch.nn.Linear(HIDDEN, VOCAB, bias=True), [0, 3, 5, 17, 40, 41], exact=False)


def test_a_shortlist_s_ids_live_on_its_head_s_device_whatever_device_they_came_from():
    """The shipped ranking is loaded on the CPU; a drafter on a GPU reads its support with the draft-stop rules
    (`index_select` on its logits), which a CPU index fails there (found on an H200). The meta device stands in."""
    head = ShortlistHead(torch.nn.Linear(HIDDEN, VOCAB, device="meta"), torch.tensor([5, 1, 3]), VOCAB)
    head.include(torch.tensor([7]))
    assert head.ids.device.type == head.support.device.type == "meta" and head.sub.weight.device.type == "meta"
    assert head.support.shape == (4,) and head.listed.device.type == "cpu"  # the host's bookkeeping stays there


def test_shortlist_head_of_gguf_blocks():
    assert qkernels.ensure(cache_root()), qkernels.why()
    torch.manual_seed(1)
    blocks = requantize_q4_1(torch.randn(VOCAB, HIDDEN))
    check_head(GGUFLinear(blocks.data, "Q4_1", None, HIDDEN), [1, 2, 8, 33, 64, 95], exact=True)


def test_shortlist_head_of_interleaved_q4k_blocks():
    """A gguf8 head's shortlist takes its rows back as the file's Q4_K blocks (any subset of rows, not groups of
    8): the same values, summed in the one-row kernel's order."""
    from utils.models.gguf_blocks import synthetic_blocks

    assert qkernels.ensure(cache_root()), qkernels.why()
    torch.manual_seed(2)
    raw = synthetic_blocks("Q4_K", VOCAB, 256)
    full = GGUFLinear(torch.ops.specdec.interleave(raw.data, qkernels.TYPES["Q4_K"]), "Q4_K", None, 256,
                      interleaved=True)
    head = ShortlistHead(full, torch.tensor([1, 2, 8, 33]), VOCAB)
    assert torch.equal(head.sub.blocks, raw.data[[1, 2, 8, 33]]) and not head.sub.interleaved
    check_head(full, [1, 2, 8, 33, 64, 95], exact=False, hidden=256)
    eight = [0, 3, 9, 17, 40, 41, 77, 95]  # a whole group: the shortlist's rows interleaved again, same bits
    head = ShortlistHead(full, torch.tensor(eight), VOCAB)
    assert head.sub.interleaved and torch.equal(head.sub.file_rows(torch.arange(8)), raw.data[eight])
    x = torch.randn(3, 256)
    assert torch.equal(head(x)[:, eight], full(x)[:, eight])
    check_head(full, eight, exact=False, hidden=256)


class FakeTokenizer:
    all_special_ids = [VOCAB - 1]

    def __len__(self):
        return VOCAB

    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]


def test_use_draft_vocab_needs_a_ranking_and_gives_the_full_head_back(tmp_path, monkeypatch):
    model = tiny_decoder("llama", seed=1, vocab=VOCAB)
    full = model.get_output_embeddings()
    tokenizer = FakeTokenizer()
    monkeypatch.setattr(draft_vocab, "RANK_FOLDER", tmp_path)
    assert "no token ranking" in use_draft_vocab(model, tokenizer, 8)
    assert model.get_output_embeddings() is full
    ranking = torch.arange(VOCAB - 1, -1, -1, dtype=torch.int32)  # most frequent: the highest ids
    torch.save({"ids": ranking, "provenance": {}}, tmp_path / f"{tokenizer_fingerprint(vocabulary(tokenizer))}.pt")
    assert "head over 8 of 96" in use_draft_vocab(model, tokenizer, 8)  # the special token is among the 8
    head = model.get_output_embeddings()
    assert isinstance(head, ShortlistHead) and head.ids.tolist() == list(range(VOCAB - 8, VOCAB))
    assert use_draft_vocab(model, tokenizer, 0) == ""
    assert model.get_output_embeddings() is full
    assert qkernels.ensure(cache_root()), qkernels.why()
    hidden = model.config.hidden_size
    blocks = requantize_q4_1(torch.randn(VOCAB, hidden)).data
    model.set_output_embeddings(GGUFLinear(torch.ops.specdec.interleave(blocks, qkernels.TYPES["Q4_1"]), "Q4_1", None,
                                           hidden, interleaved=True))
    assert "head over 8 of 96" in use_draft_vocab(model, tokenizer, 5)  # an interleaved head: whole groups of 8
    head = model.get_output_embeddings()
    assert head.ids.tolist() == list(range(VOCAB - 8, VOCAB)) and head.sub.interleaved
    packed = torch.nn.Bilinear(2, 2, VOCAB)  # any layer whose rows cannot be gathered as a plain weight's
    model.set_output_embeddings(packed)
    assert "no shortlist" in use_draft_vocab(model, tokenizer, 8) and model.get_output_embeddings() is packed


def shortlist_session(tmp_path, monkeypatch):
    """A chat session's draft-vocab part alone: a tiny drafter, a ranking of its tokens (the highest ids first), its
    messages in `.said`."""
    from utils.chat.session import Session
    from utils.chat.settings import Settings

    model = tiny_decoder("llama", seed=1, vocab=VOCAB)
    tokenizer = FakeTokenizer()
    monkeypatch.setattr(draft_vocab, "RANK_FOLDER", tmp_path)
    ranking = torch.arange(VOCAB - 1, -1, -1, dtype=torch.int32)
    torch.save({"ids": ranking, "provenance": {}}, tmp_path / f"{tokenizer_fingerprint(vocabulary(tokenizer))}.pt")
    session = Session.__new__(Session)
    session.target, session.drafter, session.tokenizer, session.drafter_tokenizer = object(), model, tokenizer, None
    session.settings, session.said = Settings(), []
    session.say = session.said.append
    return session


def test_the_chat_names_the_head_it_runs_not_the_size_asked(tmp_path, monkeypatch):
    """/draft_vocab 999999999 said `draft vocab = 999999999`, and /help showed it, over the full head."""
    session = shortlist_session(tmp_path, monkeypatch)
    model, said = session.drafter, session.said
    session.set_draft_vocab(8)
    assert session.settings.draft_vocab == 8 and said[-1].startswith("draft vocab = 8 (head over 8 of 96")
    session.set_draft_vocab(999_999_999)
    assert session.settings.draft_vocab == 0 and said[-1] == "draft vocab = all"
    assert not draft_vocab.shortlisted(model)


def test_a_draft_vocab_change_cut_short_leaves_the_head_and_the_setting_it_had(tmp_path, monkeypatch):
    """Ctrl-C (or a damaged ranking) while /draft_vocab built the new shortlist left the full head in place while
    the setting and /help still named the old shortlist: every draft then paid the whole vocabulary, unsaid."""
    session = shortlist_session(tmp_path, monkeypatch)
    model = session.drafter
    session.set_draft_vocab(16)
    shortlist = model.get_output_embeddings()

    def interrupted(tokens):
        raise KeyboardInterrupt

    monkeypatch.setattr(draft_vocab, "load_ranking", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.set_draft_vocab(8)
    assert model.get_output_embeddings() is shortlist and session.settings.draft_vocab == 16


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_greedy_speculative_with_a_shortlist_drafter_equals_autoregressive(arch, use_cache):
    target, drafter = tiny_decoder(arch, seed=0), copy.deepcopy(tiny_decoder(arch, seed=1))
    vocab = drafter.config.vocab_size
    # a shortlist that leaves out many of the target's tokens, so rounds end on unlisted ones
    drafter.set_output_embeddings(ShortlistHead(drafter.get_output_embeddings(), torch.arange(0, vocab, 3), vocab))
    want = autoregressive_generate(PROMPT, target, max_gen_len=40, eos_tokens_id=-1, use_cache=use_cache)
    got, rate = speculative_generate(PROMPT, drafter, target, gamma=4, max_gen_len=40, eos_tokens_id=-1,
                                     use_cache=use_cache)
    assert got == want
    assert 0.0 <= rate < 1.0
    assert drafter.get_output_embeddings().extra_ids.numel() > 0  # the prompt's unlisted tokens were added


class SpelledTokenizer(FakeTokenizer):
    TOKENS = {0: "\u0120prime", 1: "_prime", 2: "Prime", 3: "ab", 4: "\u0120ab", 5: "primes", 6: ".prime"}

    def convert_ids_to_tokens(self, ids):
        return [self.TOKENS.get(i, f"t{i}") for i in ids]


def test_a_heard_word_brings_its_other_spellings():
    spellings = word_spellings(vocabulary(SpelledTokenizer()))
    assert spellings[0] == [0, 1, 2, 6] and 3 not in spellings and 5 not in spellings  # 3 letters or more
    torch.manual_seed(2)
    head = ShortlistHead(torch.nn.Linear(HIDDEN, VOCAB), torch.tensor([0, 10, 11]), VOCAB, spellings)
    head.include(torch.tensor([0, 3]))  # " prime" is listed already; its other spellings come in anyway
    assert sorted(head.extra_ids.tolist()) == [1, 2, 3, 6]
    head.include(torch.tensor([0, 1]))  # heard before: nothing new
    assert sorted(head.extra_ids.tolist()) == [1, 2, 3, 6]


def test_a_generation_drafts_from_its_own_sequence_alone_whatever_came_before():
    """The shortlist hears each generation's ids afresh: sampled speculative decoding gives the same tokens for
    the same prompt and seed whatever was answered before (it added the earlier prompts' ids, so q differed)."""
    from utils.logits_processor import MultinomialProcessor

    target, drafter = tiny_decoder("llama", seed=0), copy.deepcopy(tiny_decoder("llama", seed=1))
    vocab = drafter.config.vocab_size
    drafter.set_output_embeddings(ShortlistHead(drafter.get_output_embeddings(), torch.arange(0, vocab, 3), vocab))

    def sampled(prompt):
        torch.manual_seed(7)
        return speculative_generate(prompt, drafter, target, gamma=4, max_gen_len=30, eos_tokens_id=-1,
                                    logits_processor=MultinomialProcessor(1.0))[0]

    first = sampled(PROMPT)
    heard = set(drafter.get_output_embeddings().extra_ids.tolist())
    sampled([vocab - 1 - t for t in PROMPT])  # other ids heard in between
    assert sampled(PROMPT) == first
    assert set(drafter.get_output_embeddings().extra_ids.tolist()) == heard


@torch.no_grad()
def test_one_pass_over_an_answer_shows_each_position_the_logits_it_drafted_from():
    """The acceptance head's data comes from one drafter pass over prompt and answer; it was collected with the full
    head while the chat drafts with the shortlist (its entropy feature off by up to 0.16 nats). Each position
    now sees the shipped ids and the sequence's ids up to it (with their spellings), as drafting step by step."""
    from benchmarks.train_acceptance_head import Collector

    drafter = copy.deepcopy(tiny_decoder("llama", seed=1))
    vocab = drafter.config.vocab_size
    spellings = {5: [5, 50], 50: [5, 50]}  # a word heard brings its other spelling
    drafter.set_output_embeddings(ShortlistHead(drafter.get_output_embeddings(), torch.arange(0, vocab, 3), vocab,
                                                spellings))
    seq = [4, 7, 5, 8, 13, 7, 2, 63, 50]
    collector = object.__new__(Collector)
    collector.drafter = drafter
    logits, hidden = collector.drafter_pass(seq)
    assert logits.shape == (len(seq), vocab) and hidden.shape == (len(seq), drafter.config.hidden_size)
    head = drafter.get_output_embeddings()
    head.forget()
    for position in range(len(seq)):
        head.include(torch.tensor(seq[position:position + 1]))  # what `ModelDrafter.readable` does a round
        stepwise = drafter(input_ids=torch.tensor([seq[:position + 1]])).logits[0, -1].float()
        assert torch.equal(torch.isneginf(logits[position]), torch.isneginf(stepwise))
        assert torch.allclose(logits[position], stepwise, rtol=1e-6, atol=1e-6)
    assert torch.isneginf(logits[1, 50]) and not torch.isneginf(logits[2, 50])  # listed from where 5 is heard


def test_the_tokenizer_s_special_ids_are_listed_whatever_their_rank(tmp_path, monkeypatch):
    """The drafter must still be able to propose the end of a turn: the special ids join the shortlist even where
    the ranking puts them last (the test above ranks the special token first, so it says nothing of this)."""
    model = tiny_decoder("llama", seed=1, vocab=VOCAB)
    tokenizer = FakeTokenizer()
    monkeypatch.setattr(draft_vocab, "RANK_FOLDER", tmp_path)
    ranking = torch.arange(VOCAB, dtype=torch.int32)  # most frequent: the lowest ids, the special one last
    torch.save({"ids": ranking, "provenance": {}}, tmp_path / f"{tokenizer_fingerprint(vocabulary(tokenizer))}.pt")
    assert "head over 9 of 96" in use_draft_vocab(model, tokenizer, 8)
    head = model.get_output_embeddings()
    assert head.ids.tolist() == list(range(8)) + [VOCAB - 1]
    assert torch.isfinite(head(torch.randn(1, model.config.hidden_size, dtype=model.dtype))[0, VOCAB - 1])


def test_ranked_ids_past_the_head_s_rows_are_left_out(tmp_path, monkeypatch):
    """A ranking counted for a tokenizer with more entries than the head has rows: the ids past the head are
    skipped (not gathered: an index error at start-up), the next-ranked ones take their places."""
    rows = VOCAB - 16
    model = tiny_decoder("llama", seed=1, vocab=rows)
    tokenizer = FakeTokenizer()
    tokenizer.all_special_ids = []
    monkeypatch.setattr(draft_vocab, "RANK_FOLDER", tmp_path)
    ranking = torch.arange(VOCAB - 1, -1, -1, dtype=torch.int32)  # the highest ids first: 16 of them past the head
    torch.save({"ids": ranking, "provenance": {}}, tmp_path / f"{tokenizer_fingerprint(vocabulary(tokenizer))}.pt")
    assert f"head over 8 of {rows}" in use_draft_vocab(model, tokenizer, 8)
    assert model.get_output_embeddings().ids.tolist() == list(range(rows - 8, rows))


def test_the_support_follows_the_ids_heard_after_it_was_first_read():
    """The draft-stop rules read the drafter's distribution over `support` each round; ids the conversation adds
    later (the target's unlisted tokens, their spellings) must join it, or the confidence and entropy rules read a
    softmax without the very tokens the head now computes."""
    head = ShortlistHead(torch.nn.Linear(HIDDEN, VOCAB), torch.tensor([5, 0, 3]), VOCAB)
    assert sorted(head.support.tolist()) == [0, 3, 5]  # read in a first round
    head.include(torch.tensor([7, 3]))
    assert sorted(head.support.tolist()) == [0, 3, 5, 7]
    with torch.no_grad():
        logits = head(torch.randn(1, HIDDEN))
    assert torch.isfinite(logits[0, head.support]).all() and torch.isfinite(logits).sum() == head.support.numel()
    head.forget()
    assert sorted(head.support.tolist()) == [0, 3, 5]


@torch.no_grad()
def test_each_example_is_the_drafters_view_before_the_answers_next_token(monkeypatch):
    """The head learns whether the drafter's greedy draft at a position equals the target's token there: position i
    of the answer pairs what the drafter holds after reading prompt + answer[:i] with answer[i]. Shifted by one,
    the labels judge a token the drafter had already seen."""
    from benchmarks import train_acceptance_head
    from benchmarks.train_acceptance_head import Collector

    drafter = tiny_decoder("llama", seed=1)
    prompt = [4, 7, 5, 8]
    answer = autoregressive_generate(prompt, drafter, 6, None, -1)  # the drafter's own greedy answer: all match...
    answer[3] = (answer[3] + 1) % drafter.config.vocab_size  # ...but the draft for position 3
    monkeypatch.setattr(train_acceptance_head, "chat_ids", lambda tokenizer, text: list(prompt))
    monkeypatch.setattr(train_acceptance_head, "autoregressive_run",
                        lambda *args: type("Result", (), {"tokens": list(answer)}))
    collector = object.__new__(Collector)
    collector.drafter = collector.target = drafter
    collector.tokenizer, collector.stop, collector.n = None, None, len(answer)
    x, labels, top = collector.examples("any prompt")
    assert labels[:3].tolist() == [1.0, 1.0, 0.0]  # positions 1, 2, 3 of the answer
    for i in range(1, len(answer)):
        probs = torch.softmax(drafter(input_ids=torch.tensor([prompt + answer[:i]])).logits[0, -1].float(), -1)
        assert labels[i - 1] == float(probs.argmax().item() == answer[i])
        assert top[i - 1] == pytest.approx(probs.max().item(), rel=1e-5)
        assert x[i - 1, -4] == pytest.approx(probs.max().item(), rel=1e-5)
