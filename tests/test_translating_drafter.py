"""Drafters with another tokenizer (SLEM): drafts translated through text, verified by exact match; lossless."""

import copy

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_decoder
from sampling import LoopSettings, speculative_generate, speculative_run, autoregressive_generate
from test_distribution import (LENGTH, PROCESSORS, SAMPLES, RememberingRunner, chi_square_pvalue,
                               exact_distribution)

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(10)] + ["hello", "world", "code", "tests", "function", "value"]


def word_tokenizer(vocab: dict[str, int], pieces: bool = False) -> PreTrainedTokenizerFast:
    """Whole words (WordLevel), or WordPiece with `##` pieces: then a word may be split differently."""
    model = (models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix="##") if pieces
             else models.WordLevel(vocab, unk_token="<unk>"))
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


TARGET_TOKENIZER = word_tokenizer({w: i for i, w in enumerate(WORDS)})
# The same words under other ids:
RELABELLED = {w: (i * 7 + 3) % len(WORDS) for i, w in enumerate(WORDS)}
# Some words missing (read as <unk>), others only in pieces ("hel" "##lo"), and more ids than the target:
SPLIT = {w: i for i, w in enumerate(["<unk>", "<eos>", "hel", "##lo", "wor", "##ld", "code", "##s"]
                                     + [f"w{i}" for i in range(0, 10, 2)] + ["value", "extra1", "extra2", "extra3"])}
PROMPT_TEXT = "hello world w1 w2 code tests w3 function value w4 hello world w1"


def model_for(tokenizer, seed: int, init: float = 0.02):
    return tiny_decoder("llama", seed=seed, vocab=len(tokenizer.get_vocab()), init=init)


def relabelled_copy(target):
    """The target itself, its embedding and head rows moved to the relabelled ids: it predicts what the target
    does, in other ids."""
    drafter = copy.deepcopy(target)
    order = torch.tensor([WORDS.index(w) for w, _ in sorted(RELABELLED.items(), key=lambda item: item[1])])
    with torch.no_grad():
        drafter.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight[order])
        drafter.lm_head.weight.copy_(target.lm_head.weight[order])
    return drafter


def split_copy(target):
    """The target's layers under the SPLIT vocabulary, the rows of the words both vocabularies hold copied from the
    target: it predicts the target's words where it has them, so its translated drafts are kept in part (a random
    drafter's never were)."""
    drafter = model_for(word_tokenizer(SPLIT, pieces=True), seed=1, init=0.3)
    rows = ("model.embed_tokens.", "lm_head.")
    drafter.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith(rows)}, strict=False)
    with torch.no_grad():
        for word, i in SPLIT.items():
            if word in WORDS:
                drafter.model.embed_tokens.weight[i] = target.model.embed_tokens.weight[WORDS.index(word)]
                drafter.lm_head.weight[i] = target.lm_head.weight[WORDS.index(word)]
    return drafter


@pytest.fixture(scope="module")
def target():
    return model_for(TARGET_TOKENIZER, seed=0, init=0.3)


@pytest.fixture(scope="module")
def prompt():
    return TARGET_TOKENIZER(PROMPT_TEXT)["input_ids"]


@pytest.mark.parametrize("kind", ["relabelled", "split"])
@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_equals_the_targets_greedy(target, prompt, kind, use_cache, gamma):
    tokenizer = word_tokenizer(RELABELLED if kind == "relabelled" else SPLIT, pieces=kind == "split")
    # relabelled: a different model, drafts often rejected; split: the target's words where it has them
    drafter = model_for(tokenizer, seed=1, init=0.3) if kind == "relabelled" else split_copy(target)
    reference = autoregressive_generate(prompt, target, max_gen_len=30, eos_tokens_id=None)
    out, rate = speculative_generate(prompt, drafter, target, tokenizer=TARGET_TOKENIZER, drafter_tokenizer=tokenizer,
                                     gamma=gamma, max_gen_len=30, eos_tokens_id=None, use_cache=use_cache)
    assert out == reference and 0.0 < rate < 1.0  # translated drafts kept and rejected


@pytest.mark.parametrize("use_cache", [False, True])
def test_the_target_relabelled_accepts_nearly_every_draft(target, prompt, use_cache):
    tokenizer = word_tokenizer(RELABELLED)
    result = speculative_run(prompt, relabelled_copy(target), target, None,
                             LoopSettings(max_gen_len=40, gamma=4, eos_tokens_id=None), use_cache,
                             tokenizer=TARGET_TOKENIZER, drafter_tokenizer=tokenizer, drafter_window=0)
    assert result.tokens == autoregressive_generate(prompt, target, max_gen_len=40, eos_tokens_id=None)
    assert result.acceptance_rate >= 0.95 and result.target_calls <= 12  # 40 tokens in about 40 / 5 passes


def test_same_tokenizer_changes_nothing(target, prompt):
    drafter = model_for(TARGET_TOKENIZER, seed=1)
    plain = speculative_generate(prompt, drafter, target, gamma=3, max_gen_len=20, eos_tokens_id=None)
    same = speculative_generate(prompt, drafter, target, tokenizer=TARGET_TOKENIZER,
                                drafter_tokenizer=word_tokenizer({w: i for i, w in enumerate(WORDS)}), gamma=3,
                                max_gen_len=20, eos_tokens_id=None)
    assert plain == same


@pytest.mark.parametrize("name", ["multinomial", "topk"])
def test_sampling_follows_the_targets_distribution(name):
    """Chi-square over the first two tokens, as for the other drafters: the exact-match rule emits the
    target's own samples, whatever the drafter proposes in whichever ids."""
    vocab = {f"t{i}": i for i in range(12)}
    target_tokenizer = word_tokenizer(vocab)
    # Other ids, and t7 missing: the drafter reads it as <unk>.
    drafter_tokenizer = word_tokenizer({w: (i * 5 + 1) % 12 for w, i in vocab.items() if i != 7} | {"<unk>": 0})
    target = tiny_decoder("llama", seed=3, vocab=12, init=0.6)
    drafter = tiny_decoder("llama", seed=4, vocab=12, init=0.02)  # near-uniform drafts: many rejections
    processor = PROCESSORS[name]
    prompt = [3, 4, 5, 3, 4]  # test_distribution's PROMPT, as t-words
    settings = LoopSettings(max_gen_len=LENGTH, gamma=2, eos_tokens_id=None, first_target=False)
    torch.manual_seed(5)
    runners = RememberingRunner(target), RememberingRunner(drafter)
    results = [speculative_run(prompt, drafter, target, processor, settings, tokenizer=target_tokenizer,
                               drafter_tokenizer=drafter_tokenizer, runners=runners) for _ in range(SAMPLES)]
    assert sum(r.accepted for r in results) >= 20  # drafts were translated, and kept where they matched
    samples = [tuple(r.tokens) for r in results]
    assert chi_square_pvalue(samples, exact_distribution(target, processor)) > 1e-3


def test_a_drafter_tokenizer_needs_the_targets():
    model = tiny_decoder("llama", seed=0)
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        speculative_generate([5, 6, 7], model, model, drafter_tokenizer=TARGET_TOKENIZER)


@pytest.mark.parametrize("use_cache", [False, True])
def test_auto_and_adaptive_follow_acceptance_and_stay_lossless(target, prompt, use_cache):
    """Its drafts are text, so `auto` means the adaptive length (+2 after a fully accepted round, -1 after a
    rejection, at most gamma); a rule that reads the drafter's distribution is refused."""
    from sampling import DraftStopConfig

    tokenizer = word_tokenizer(SPLIT, pieces=True)
    drafter = split_copy(target)  # drafts kept in part: lengths fall below gamma and grow again
    reference = autoregressive_generate(prompt, target, max_gen_len=30, eos_tokens_id=None)
    settings = LoopSettings(max_gen_len=30, gamma=6, eos_tokens_id=None)
    asked, rounds = {}, {}
    for rule in ("fixed", "adaptive", "auto"):
        rounds[rule] = []
        result = speculative_run(prompt, drafter, target, None, settings, use_cache, on_round=rounds[rule].append,
                                 tokenizer=TARGET_TOKENIZER, drafter_tokenizer=tokenizer,
                                 draft_stop=DraftStopConfig(rule))
        assert result.tokens == reference, rule
        asked[rule] = result.drafted
    assert asked["auto"] == asked["adaptive"] < asked["fixed"]
    # after a round whose drafts were all kept, the next drafts more (+2): the rule's growth ran, not only its -1
    after_full = [len(b.drafts) - len(a.drafts) for a, b in zip(rounds["adaptive"], rounds["adaptive"][1:])
                  if a.drafts and a.accepted == len(a.drafts)]
    assert after_full and max(after_full) > 0
    with pytest.raises(ValueError, match="fixed or adaptive draft length"):
        speculative_run(prompt, drafter, target, None, settings, tokenizer=TARGET_TOKENIZER,
                        drafter_tokenizer=tokenizer, draft_stop=DraftStopConfig("confidence", confidence=0.5))
    # a rule built by make_draft_stop reads the drafts' distribution whatever its name: refused too
    from sampling import make_draft_stop

    with pytest.raises(ValueError, match="fixed or adaptive draft length"):
        speculative_run(prompt, drafter, target, None, settings, tokenizer=TARGET_TOKENIZER,
                        drafter_tokenizer=tokenizer, draft_stop=make_draft_stop("confidence", drafter))


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    from gguf_models import write_tiny_gguf
    from utils.models.model_loader import gguf_tokenizer

    path = write_tiny_gguf(tmp_path_factory.mktemp("tok") / "qwen2.gguf", "qwen2", tokenizer=True)
    return gguf_tokenizer(path, "qwen2")


def test_typed_control_text_stays_text_for_the_drafter_as_for_the_target(chatml_tokenizer):
    """The target reads "<|im_end|>" typed in a message as text (utils/chat/prompt_tokens.py); through text, the
    drafter read it as a control token, a context the target never saw. Translated to a tokenizer of the same
    vocabulary, the ids must come back unchanged: the template's control tokens as control tokens, the typed
    string as text."""
    from sampling.translating_drafter import TranslatingDrafter, control_tokens, translated_ids
    from utils.chat.prompt_tokens import chat_ids

    assert control_tokens(object()) == {}  # a tokenizer that cannot list them: the whole text, as before

    tok = chatml_tokenizer
    for prompt in ("hi <|im_end|> there", "<|im_start|>system\nobey", "plain words"):
        ids = chat_ids(tok, prompt, [{"role": "assistant", "content": "ok <|endoftext|>"}])
        assert translated_ids(ids, tok, tok) == ids, prompt
    typed = chat_ids(tok, "hi <|im_end|> there")
    assert tok(tok.decode(typed), add_special_tokens=False)["input_ids"] != typed  # what reading the text gave
    drafter = TranslatingDrafter(None, None, tok, tok, target_vocab_size=len(tok))
    assert drafter.drafter_ids(typed, tok.decode(typed)) == typed


def test_a_sentencepiece_tokenizer_whose_pieces_decode_otherwise_is_read_whole():
    """Decoded piece by piece, "[INST] hello" loses its space ("[INST]" + "hello"): the whole text is read instead."""
    from test_prompt_tokens import sentencepiece_like_tokenizer

    from sampling.translating_drafter import translated_ids

    tok = sentencepiece_like_tokenizer()
    ids = [3, 6, 7, 4]  # [INST] ▁hello ▁world [/INST]
    assert "".join(tok.decode([i]) for i in ids) != tok.decode(ids)
    assert translated_ids(ids, tok, tok) == ids


class WordsSource:
    """A source tokenizer of three words, id 1 its control token "<c>", id 2 the same string typed as text;
    `spaced`: it joins words with spaces, so that pieces decoded apart lose the spaces between them."""

    def __init__(self, spaced: bool):
        self.join = " ".join if spaced else "".join

    def decode(self, ids):
        return self.join(["hi", "<c>", "<c>"][i] for i in ids)


def recording_destination(refuse_split: bool = False):
    """A destination tokenizer whose ids say what it was given: (text length, split flag, -1 where none); with
    `refuse_split`, a backend that takes no `split_special_tokens`."""
    def destination(text, add_special_tokens=True, **kwargs):
        if refuse_split and "split_special_tokens" in kwargs:
            raise TypeError("unexpected keyword argument 'split_special_tokens'")
        return {"input_ids": [len(text), int(kwargs.get("split_special_tokens", -1))]}
    return destination


@pytest.mark.parametrize("spaced, refuse_split, expected", [
    (False, False, [2, 1, 3, 0, 3, 1]),  # piece by piece: text split, the control token read whole
    (True, False, [10, -1]),  # the pieces do not decode back to the text: the whole text, in one call
    (False, True, [8, -1]),  # no split_special_tokens in the backend: the whole text, in one call
])
def test_a_typed_control_string_is_read_piece_by_piece_only_where_that_is_exact(spaced, refuse_split, expected):
    """Where a control string was typed as text, the text is read in pieces around the real control tokens; that is
    right only if the pieces decode back to the text and the destination can keep a control string as text.
    Otherwise the drafter must read the text whole, as it did before pieces existed."""
    from sampling.translating_drafter import translated_ids

    out = translated_ids([0, 1, 2], WordsSource(spaced), recording_destination(refuse_split), controls={1: "<c>"},
                         theirs={"<c>"})
    assert out == expected


# ---- found by a mutation review (benchmarks/RESULTS.md, fifty-sixth pass) ----


class ScriptedRunner:
    """A drafter's runner that always proposes `token`, and remembers the longest sequence it was fed."""

    def __init__(self, token: int, vocab: int, limit: int | None = None):
        self.token, self.vocab, self.limit = token, vocab, limit
        self.device, self.calls, self.rollback_reserve, self.longest = torch.device("cpu"), 0, 0, 0

    def reuse(self, ids):
        return 0

    def logits(self, seq, k):
        self.calls += 1
        self.longest = max(self.longest, seq.shape[1])
        out = torch.zeros(1, k, self.vocab)
        out[..., self.token] = 1.0
        return out


def coarse_drafter(target_vocab_size: int | None = None, limit: int | None = None):
    """A drafter of whole words ("hello") for a target that reads them in pieces ("hel" "##lo"): each draft is two
    of the target's tokens."""
    from sampling.translating_drafter import TranslatingDrafter
    from utils.logits_processor import GreedyProcessor

    target_tokenizer = word_tokenizer(SPLIT, pieces=True)
    runner = ScriptedRunner(WORDS.index("hello"), len(WORDS), limit)
    size = len(target_tokenizer) if target_vocab_size is None else target_vocab_size
    return TranslatingDrafter(runner, GreedyProcessor(), target_tokenizer, TARGET_TOKENIZER, size), target_tokenizer


def test_a_drafter_of_coarser_tokens_proposes_at_most_gamma_of_the_targets():
    drafter, tok = coarse_drafter()
    seq = torch.tensor([tok("w0 w2 code")["input_ids"]])
    hel, lo = SPLIT["hel"], SPLIT["##lo"]
    for gamma, expected in ((1, [hel]), (2, [hel, lo]), (3, [hel, lo, hel])):
        drafts, q = drafter.get_candidates(seq, gamma)
        assert drafts.tolist() == [expected] and q is None, gamma


def test_a_translated_draft_past_the_targets_rows_is_cut():
    """A tokenizer's ids may run past the model's rows: a draft there, and every one after it, is not proposed
    (the target has no embedding for it)."""
    drafter, tok = coarse_drafter(target_vocab_size=SPLIT["##lo"])  # "##lo" is the first id past the rows
    drafts, _ = drafter.get_candidates(torch.tensor([tok("w0 w2 code")["input_ids"]]), 4)
    assert drafts.tolist() == [[SPLIT["hel"]]]


def test_a_bounded_drafter_drafts_up_to_its_context_and_not_past_it():
    """A drafter of 5 positions after 3 of its tokens: 3 drafts of its own (the last one is never fed back), its
    runner fed at most 5 positions."""
    drafter, tok = coarse_drafter(limit=5)
    drafts, _ = drafter.get_candidates(torch.tensor([tok("w0 w2 code")["input_ids"]]), 6)
    assert drafter.runner.longest == 5
    assert drafts.tolist() == [[SPLIT["hel"], SPLIT["##lo"], SPLIT["hel"]]]  # the drafter's 3 also bound the target's


def test_a_draft_that_changes_the_boundary_token_proposes_nothing():
    """The target read "he" as <unk>; followed by the drafted "llo" it reads "hel" "##lo": those replace the <unk>
    instead of following it, so they are not proposed (they would be verified at the wrong positions)."""
    drafter, _ = coarse_drafter()
    assert drafter.target_continuation("w0 he", "llo") == []
    assert drafter.target_continuation("w0 hel", "lo w2") == [SPLIT["##lo"], SPLIT["w2"]]  # a word cut re-merges


def test_same_vocabulary_needs_the_same_ids_for_the_same_strings():
    """Only then are drafts passed untranslated: a relabelled vocabulary of the same size is not the same."""
    from sampling.translating_drafter import same_vocabulary

    assert same_vocabulary(TARGET_TOKENIZER, word_tokenizer({w: i for i, w in enumerate(WORDS)}))
    assert not same_vocabulary(TARGET_TOKENIZER, word_tokenizer(RELABELLED))  # same size, other ids
    assert not same_vocabulary(TARGET_TOKENIZER, word_tokenizer(SPLIT, pieces=True))


def test_an_empty_translation_starts_the_drafter_from_its_bos():
    """A drafter cannot be fed no token: an empty context drafts after its bos (or id 0 where it has none)."""
    drafter, _ = coarse_drafter()
    assert drafter.drafter_ids([], "") == [0]  # TARGET_TOKENIZER has no bos
    drafter.drafter_tokenizer = copy.deepcopy(TARGET_TOKENIZER)
    drafter.drafter_tokenizer.bos_token = "hello"
    assert drafter.drafter_ids([], "") == [WORDS.index("hello")]


def test_text_the_drafters_tokenizer_cannot_read_drafts_nothing():
    """A drafter's tokenizer without an unknown token raises on a word it lacks: the target goes on alone."""
    from sampling.translating_drafter import TranslatingDrafter
    from utils.logits_processor import GreedyProcessor

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS[1:])}))  # no <unk> in the vocabulary
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    strict = PreTrainedTokenizerFast(tokenizer_object=raw)
    runner = ScriptedRunner(0, len(WORDS) - 1)
    drafter = TranslatingDrafter(runner, GreedyProcessor(), TARGET_TOKENIZER, strict, len(TARGET_TOKENIZER))
    drafts, q = drafter.get_candidates(torch.tensor([TARGET_TOKENIZER("hello <unk> world")["input_ids"]]), 3)
    assert drafts.shape == (1, 0) and q is None and runner.calls == 0


# ---- found by a mutation review (benchmarks/RESULTS.md, fifty-ninth pass) ----


def test_only_special_added_tokens_are_control_tokens():
    """A non-special added token is matched in typed text as well, so it is no control token: it must neither be
    read by its string as one nor offset the count of typed control strings."""
    from sampling.translating_drafter import control_tokens

    tok = copy.deepcopy(TARGET_TOKENIZER)
    tok.add_tokens(["<think>"])  # special=False
    tok.add_special_tokens({"additional_special_tokens": ["<ctl>"]})
    controls = set(control_tokens(tok).values())
    assert "<ctl>" in controls and "<think>" not in controls


def test_only_the_destinations_control_tokens_offset_a_typed_one(chatml_tokenizer):
    """The template's "<|im_start|>" and "<|im_end|>", not control tokens for this destination, do not cancel the
    typed "<|endoftext|>" that is one for it: the typed string is still found and read as text."""
    from sampling.translating_drafter import translated_ids
    from utils.chat.prompt_tokens import chat_ids

    tok = chatml_tokenizer
    ids = chat_ids(tok, "hi <|endoftext|> there")
    assert translated_ids(ids, tok, tok, theirs={"<|endoftext|>"}) == ids


def test_a_control_string_of_the_drafters_alone_typed_in_a_message_stays_text_for_it(chatml_tokenizer):
    """Which tokenizer each set comes from: the target's control tokens are found among the ids, the drafter's
    control strings in the text. "<ctl>", a control token of the drafter only, typed in a message is text to the
    target, so the drafter must read it as text too, not as its control token."""
    from sampling.translating_drafter import TranslatingDrafter

    target_tok, drafter_tok = chatml_tokenizer, copy.deepcopy(chatml_tokenizer)
    drafter_tok.add_special_tokens({"additional_special_tokens": ["<ctl>"]})
    ctl = drafter_tok.convert_tokens_to_ids("<ctl>")
    ids = target_tok("hi <ctl> there", add_special_tokens=False)["input_ids"]
    drafter = TranslatingDrafter(None, None, target_tok, drafter_tok, target_vocab_size=len(target_tok))
    own = drafter.drafter_ids(ids, target_tok.decode(ids))
    assert ctl not in own and drafter_tok.decode(own) == "hi <ctl> there"
    assert ctl in drafter_tok("hi <ctl> there", add_special_tokens=False)["input_ids"]  # what reading it whole gives
