"""The chat session in process: streaming, reports and settings that change only when the change succeeds."""

import io
import re
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cli_models import tiny_session, write_tiny_model
from sampling import GenerationResult, Round
from utils.chat.commands import CommandError, help_text, parse_command
from utils.chat.session import Session, Stream
from utils.chat.settings import Settings
from utils.models.model_loader import load_model


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return tiny_session(tmp_path_factory.mktemp("model"), length=6)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (GPT-2's byte alphabet, no merges): a multi-byte character spans several tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_an_answer_ending_inside_a_character_is_flushed():
    tokenizer = byte_tokenizer()
    ids = tokenizer("ab é")["input_ids"]
    assert len(ids) == 5  # é is two bytes
    out = io.StringIO()
    stream = Stream(tokenizer, out, debug=False)
    stream.on_round(Round(drafts=[], accepted=0, tokens=ids[:3]))
    stream.on_round(Round(drafts=[], accepted=0, tokens=ids[3:4]))  # the first byte of é: held back
    assert out.getvalue() == "ab "
    stream.end()
    assert out.getvalue() == "ab \ufffd\n" == tokenizer.decode(ids[:4]) + "\n"  # what the report says too


def test_debug_rounds_show_a_character_split_across_tokens_whole(monkeypatch):
    """A sweep's `/debug` on emoji: each token decoded alone showed U+FFFD for every byte of a split character, in
    rounds whose plain stream read right."""
    monkeypatch.setenv("NO_COLOR", "1")
    tokenizer = byte_tokenizer()
    ids = tokenizer(" 🍞 é!")["input_ids"]  # 🍞: bytes 1-4, é: 6-7
    assert len(ids) == 9
    out = io.StringIO()
    stream = Stream(tokenizer, out, debug=True)
    stream.on_round(Round(drafts=ids[0:2], accepted=2, tokens=ids[0:3]))  # 🍞's first byte kept: nothing to show yet
    stream.on_round(Round(drafts=ids[3:4], accepted=1, tokens=ids[3:5]))  # the target's token completes it
    stream.on_round(Round(drafts=ids[5:7], accepted=2, tokens=ids[5:8]))
    stream.on_round(Round(drafts=ids[6:7], accepted=0, tokens=ids[8:9]))  # a rejected draft, é's first byte again
    assert out.getvalue().splitlines() == ["[+ +][++]", "[++]🍞", "[+ +][++]é", "[-\ufffd-]!"]  # the last: never whole


def test_debug_rounds_end_with_the_character_an_answer_ended_inside(monkeypatch):
    """An answer cut inside a character: the plain stream and the report end in U+FFFD, and `/debug` showed
    nothing of the held bytes."""
    monkeypatch.setenv("NO_COLOR", "1")
    tokenizer = byte_tokenizer()
    ids = tokenizer("ab é")["input_ids"]
    out = io.StringIO()
    stream = Stream(tokenizer, out, debug=True)
    stream.on_round(Round(drafts=ids[:3], accepted=3, tokens=ids[:4]))  # the target's token: é's first byte
    assert out.getvalue() == "[+a+][+b+][+ +]\n"
    stream.end()
    assert out.getvalue().splitlines() == ["[+a+][+b+][+ +]", "\ufffd"]
    complete = io.StringIO()
    stream = Stream(tokenizer, complete, debug=True)
    stream.on_round(Round(drafts=ids[:3], accepted=3, tokens=ids[:4]))
    stream.on_round(Round(drafts=[], accepted=0, tokens=ids[4:5]))
    stream.end()  # nothing held: no line
    assert complete.getvalue().splitlines() == ["[+a+][+b+][+ +]", "é"]


def test_nothing_drafted_is_not_zero_acceptance(session, monkeypatch):
    monkeypatch.setattr(session, "generate", lambda *a: GenerationResult(tokens=[5], drafted=0, target_calls=1))
    report = session.run_block("ngram", [4, 5, 6], [1], baseline=None)
    assert report.acceptance_rate is None
    assert "acceptance n/a (nothing drafted)" in session.out.getvalue()


def test_nasds_settings_reach_its_run(session, monkeypatch):
    """/top_k_filler, the cache and the prior switch are NASD's arguments: one dropped still answered the same
    tokens (NASD is lossless), only slower."""
    from utils.chat import session as chat_session

    calls = []
    monkeypatch.setattr(chat_session, "nasd_run", lambda *args, **kwargs: calls.append((args, kwargs)))
    settings, shipped = session.settings, object()
    monkeypatch.setattr(session, "prior", shipped)  # the tiny tokenizer has none shipped
    for filler, prior in ((5, True), (2, False)):
        monkeypatch.setattr(settings, "top_k_filler", filler)
        monkeypatch.setattr(settings, "ngram_prior", prior)
        session.generate("ngram", [4, 5, 6], [1], None, 3)
        (ids, storage, target, processor, loop, top_k_filler, use_cache), kwargs = calls[-1]
        assert (top_k_filler, use_cache, loop.gamma) == (filler, settings.use_cache, 3)
        assert storage is session.storage and kwargs["prior"] is (shipped if prior else None)


def test_forwards_are_counted_for_the_model_that_ran_and_errors_keep_their_type(session, monkeypatch):
    monkeypatch.setattr(session, "generate", lambda *a: GenerationResult(tokens=[5, 6], target_calls=2))
    drafter = session.run_block("drafter", [4, 5, 6], [1], baseline=None)
    assert (drafter.target_forwards, drafter.drafter_forwards) == (0, 2)
    assert "2 drafter forwards" in session.out.getvalue()
    monkeypatch.setattr(session, "generate", lambda *a: GenerationResult(tokens=[5], target_calls=1, drafter_calls=3))
    speculative = session.run_block("speculative", [4, 5, 6], [1], baseline=None)
    assert (speculative.target_forwards, speculative.drafter_forwards) == (1, 3)

    def fail(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(session, "generate", fail)
    assert session.run_block("target", [4, 5, 6], [1], baseline=None).error == "RuntimeError: boom"


def test_an_interrupted_storage_change_changes_nothing(session, monkeypatch):
    before = (session.settings.ngram_kind, session.settings.ngram_n, session.storage)

    def interrupted(kind, n):
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "make_storage", interrupted)
    command, values = parse_command("/set_ngramstorage onelevel 5")
    with pytest.raises(KeyboardInterrupt):
        command.run(session, *values)
    assert (session.settings.ngram_kind, session.settings.ngram_n, session.storage) == before
    with pytest.raises(CommandError, match="N must be an integer from 2 to 16"):
        parse_command("/set_ngramstorage basic 10000000")


def test_a_new_storage_says_it_will_replace_the_ngram_cache_file(session, monkeypatch):
    command, values = parse_command("/set_ngramstorage basic 3")
    command.run(session, *values)
    assert session.out.getvalue().rstrip().endswith("n-gram storage = basic n=3")
    monkeypatch.setattr(session, "ngram_cache", "/tmp/chat.ngram")  # --ngram-cache: saved after every answer
    command.run(session, *values)
    assert session.out.getvalue().rstrip().endswith("(empty: NASD's next answer saves it over /tmp/chat.ngram)")


def test_a_fresh_storage_per_prompt_says_it_will_replace_the_ngram_cache_file(session, monkeypatch):
    """A sweep: `/reset_in_between` on beside --ngram-cache said only "reset_in_between: on", and the next answer
    saved its fresh storage over the file's 68 contexts."""
    command, _ = parse_command("/reset_in_between")
    monkeypatch.setattr(session.settings, "reset_in_between", False)
    command.run(session)
    assert session.out.getvalue().rstrip().endswith("reset_in_between: on")  # no cache file: nothing to say
    command.run(session)
    monkeypatch.setattr(session, "ngram_cache", "/tmp/chat.ngram")
    command.run(session)
    assert session.out.getvalue().rstrip().endswith(
        "reset_in_between: on\n(each prompt's fresh storage replaces the n-gram cache: NASD's next answer saves it "
        "over /tmp/chat.ngram)")
    command.run(session)
    assert session.out.getvalue().rstrip().endswith("reset_in_between: off")


def test_a_prompt_may_start_with_a_slash_after_an_escape(session, monkeypatch):
    seen = []
    monkeypatch.setattr(session, "answer", lambda prompt: seen.append(prompt) or [])
    session.handle("//etc/hosts: what is this file?")
    assert seen == ["/etc/hosts: what is this file?"]
    with pytest.raises(CommandError, match="unknown command"):
        session.handle("/etc/hosts")


def test_invalid_utf8_is_named(session):
    with pytest.raises(CommandError, match="not valid UTF-8"):
        session.answer(b"caf\xe9".decode("utf-8", "surrogateescape"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and drafter in float64, so that a shorter prefill cannot flip a near-tie by rounding."""
    base = tmp_path_factory.mktemp("pair")
    write_tiny_model(base / "target", seed=0, context=160)
    write_tiny_model(base / "drafter", seed=1, context=160)
    target, tokenizer = load_model(str(base / "target"), device="cpu", dtype="float32", progress=False)
    drafter, _ = load_model(str(base / "drafter"), device="cpu", dtype="float32", progress=False)
    return target.double(), drafter.double(), tokenizer


PROMPTS = ["hello world", "write a function", "w1 w2 w3 code", "hello code", "a function : w4", "w5 w6 world"]


def conversation(pair, reuse: bool, prompts=PROMPTS, length=8):
    target, drafter, tokenizer = pair
    chat = Session(target, drafter, tokenizer, Settings(length=length, use_cache=True, gamma=3))
    chat.out = io.StringIO()
    turns = []
    for prompt in prompts:
        if not reuse:
            chat.kept.clear()  # every turn prefills the whole conversation
        turns.append({r.generator: r for r in chat.answer(prompt)})
    return chat, turns


def test_kv_caches_kept_across_turns_change_no_token(pair, monkeypatch):
    from utils.model_runner import ModelRunner

    kept_positions = []
    original = ModelRunner.reuse
    monkeypatch.setattr(ModelRunner, "reuse", lambda self, ids: kept_positions.append(original(self, ids)) or kept_positions[-1])
    chat, reused = conversation(pair, reuse=True)
    assert max(kept_positions) > 40  # later turns kept the earlier conversation's entries
    monkeypatch.setattr(ModelRunner, "reuse", original)
    _, fresh = conversation(pair, reuse=False)
    for turn_reused, turn_fresh in zip(reused, fresh):
        for name in ("target", "speculative", "ngram", "drafter"):
            assert turn_reused[name].error is None
            assert turn_reused[name].token_ids == turn_fresh[name].token_ids, name
    assert reused[0]["speculative"].token_ids == reused[0]["target"].token_ids  # and still lossless
    chat.reset_conversation()
    assert chat.kept == {}


def test_a_long_conversation_drops_its_oldest_turns_and_keeps_answering(pair):
    prompts = [f"w{i % 50} w{(i * 7) % 50} hello world write code" for i in range(40)]
    chat, turns = conversation(pair, reuse=True, prompts=prompts, length=12)
    assert len(turns) == 40 and all(r.error is None and r.tokens_generated for t in turns for r in t.values())
    assert re.search(r"dropped the \d+ oldest turns? of the conversation to fit the context of 160 tokens",
                     chat.out.getvalue())
    ids, history = chat.fit_context("w1")
    assert len(ids) + 12 <= 160 and len(chat.history) < 2 * 40


def test_a_turn_without_an_answer_leaves_the_conversation_as_it_was(pair, monkeypatch):
    prompts = [f"w{i % 50} w{(i * 7) % 50} hello world write code" for i in range(12)]
    chat, _ = conversation(pair, reuse=True, prompts=prompts, length=12)
    history = list(chat.history)
    # every generator fails: neither the prompt nor an empty reply joins, and no turn is dropped for it
    monkeypatch.setattr(Session, "generate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    chat.out = io.StringIO()  # this prompt's lines alone
    reports = chat.answer("w3 w4 hello world write code, a prompt long enough to drop a turn")
    assert reports and all(r.error for r in reports) and chat.history == history
    assert "oldest turn" in chat.out.getvalue()  # this prompt did need a turn dropped
    monkeypatch.undo()

    def interrupted_in(generator):
        def generate(self, name, *args):
            if name == generator:
                raise KeyboardInterrupt
            return original(self, name, *args)
        return generate

    original = Session.generate
    monkeypatch.setattr(Session, "generate", interrupted_in("target"))  # Ctrl-C before any answer
    with pytest.raises(KeyboardInterrupt):
        chat.answer("w3 w4 hello world write code, a prompt long enough to drop a turn")
    assert chat.history == history
    assert chat.interrupt_note == "; the conversation goes on without this prompt"
    monkeypatch.undo()
    assert chat.answer("w5 hello")[0].error is None and len(chat.history) <= len(history) + 2
    assert chat.history[-2]["content"] == "w5 hello" and chat.history[-1]["content"]


@pytest.mark.parametrize("interrupted", ["ngram", "saving"])
def test_ctrl_c_after_an_answer_keeps_the_turn(pair, monkeypatch, interrupted):
    """A sweep: Ctrl-C in NASD's answer, after the target's and speculative decoding's were shown whole, dropped
    the turn, and the next prompt ("Add a balance method.") was answered without it. A review: so did a Ctrl-C
    while the n-gram cache file was saved after every answer."""
    chat, _ = conversation(pair, reuse=True, prompts=PROMPTS[:1], length=8)
    history = list(chat.history)
    original = Session.generate

    def generate(self, name, *args):
        if name == interrupted:
            raise KeyboardInterrupt
        return original(self, name, *args)

    def save():
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "generate", generate)
    if interrupted == "saving":
        monkeypatch.setattr(chat, "ngram_cache", "/tmp/unused.ngram")
        monkeypatch.setattr(chat, "save_ngram_cache", save)
    with pytest.raises(KeyboardInterrupt):
        chat.answer(PROMPTS[1])
    target_answer = re.search(r"── target autoregressive ──\n(.*)\n", chat.out.getvalue()).group(1)
    assert chat.history == history + [{"role": "user", "content": PROMPTS[1]},
                                      {"role": "assistant", "content": target_answer}]
    assert chat.interrupt_note == "; the conversation keeps the answer of target autoregressive"
    chat.settings.chat = False  # no conversation: nothing kept, nothing said of it
    with pytest.raises(KeyboardInterrupt):
        chat.answer(PROMPTS[2])
    assert chat.interrupt_note == "" and len(chat.history) == len(history) + 2


def test_ctrl_c_mid_pass_keeps_the_counted_cache_for_the_next_turn(pair, monkeypatch):
    # Each Ctrl-C used to drop the generator's kept caches: with a long conversation the next turn read it all again
    # (a 5k-token one: 50 s on the Xeon of RESULTS.md). The runner cuts its cache back to what it counts instead.
    from utils.caching import cache_length
    from utils.model_runner import ModelRunner

    chat, _ = conversation(pair, reuse=True, prompts=PROMPTS[:2])
    forward, passes = ModelRunner.forward, []

    def forward_then_ctrl_c(self, *args):  # the worst moment: the pass wrote the cache, its count did not follow
        out = forward(self, *args)
        passes.append(self)
        if len(passes) == 3:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(ModelRunner, "forward", forward_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        chat.answer(PROMPTS[2])
    interrupted = passes[-1]
    assert chat.kept["target"] is interrupted  # the target was answering, and keeps its runner
    assert cache_length(interrupted.cache) == interrupted.cached > 20  # cut back to what it counts
    monkeypatch.setattr(ModelRunner, "forward", forward)
    reused = {}
    reuse = ModelRunner.reuse
    monkeypatch.setattr(ModelRunner, "reuse", lambda self, ids: reused.setdefault(id(self), reuse(self, ids)))
    after = {r.generator: r for r in chat.answer(PROMPTS[3])}
    assert reused[id(interrupted)] > 20  # it read only what follows the conversation it shares
    monkeypatch.setattr(ModelRunner, "reuse", reuse)
    _, fresh = conversation(pair, reuse=False, prompts=[*PROMPTS[:2], PROMPTS[3]])
    for name in ("target", "speculative", "ngram", "drafter"):
        assert after[name].error is None and after[name].token_ids == fresh[-1][name].token_ids, name


def test_a_prompt_too_long_even_alone_is_refused_and_the_conversation_stays(pair):
    chat, _ = conversation(pair, reuse=True, prompts=PROMPTS[:2], length=12)
    history = list(chat.history)
    assert len(history) == 4
    with pytest.raises(CommandError, match=r"the prompt is \d+ tokens long; the target's context is 160"):
        chat.answer("hello " * 170)
    assert chat.history == history  # not dropped for a prompt that was refused anyway
    assert "oldest turn" not in chat.out.getvalue()
    assert chat.answer("hello world")[0].error is None
    history = list(chat.history)
    chat.settings.chat = False  # the conversation is kept aside, not read: a long prompt drops none of it
    chat.answer("hello " * 152)  # fits alone (< 160), not beside a full answer of 12
    assert chat.history == history and "oldest turn" not in chat.out.getvalue()


def test_first_token_time_is_reported(session):
    report = session.answer("hello world")[0]
    assert 0 < report.first_token_s <= report.seconds
    assert f"first token {report.first_token_s:.2f} s" in session.out.getvalue()


def test_auto_draft_stop_follows_the_cache_and_the_processor(session):
    from sampling.draft_stop import DraftStopConfig

    def run(line):
        command, values = parse_command(line)
        command.run(session, *values)

    settings = session.settings
    was = (settings.processor, settings.use_cache)
    try:
        assert settings.draft_stop.rule == "auto" and not settings.use_cache
        assert session.stop_config() == DraftStopConfig("confidence", confidence=0.6)  # cache off, greedy
        run("/processor nucleus 0.7 0.9")
        assert session.stop_config() == DraftStopConfig("confidence", confidence=0.75)  # cache off, sampled
        assert session.draft_stop().confidence == 0.75  # the rule the speculative generator gets
        settings.use_cache = True
        assert session.stop_config() == DraftStopConfig("confidence", confidence=0.9)
    finally:
        settings.processor, settings.use_cache = was


def test_a_ctrl_c_that_something_swallowed_still_stops_the_answer(session, monkeypatch):
    import signal

    from utils.chat import session as session_module
    from utils.chat.interrupts import interruptible

    rounds, shown = [], session_module.Stream.on_round

    def swallowing(stream, step):  # as a finaliser would: the KeyboardInterrupt raised inside it is dropped
        rounds.append(step)
        if len(rounds) == 2:
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass
        shown(stream, step)

    monkeypatch.setattr(session_module.Stream, "on_round", swallowing)
    monkeypatch.setattr(session.settings, "length", 200)
    monkeypatch.setattr(session.settings, "enabled", dict(session.settings.enabled, target=True))
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with interruptible():
            session.answer("hello world")
    assert len(rounds) == 2  # stopped at the next round, not after 200 tokens
    assert signal.getsignal(signal.SIGINT) is before  # the handler before it is back (no absorbing asked for)


def test_presses_after_the_one_that_stopped_an_answer_are_absorbed_until_the_prompt_is_back():
    """A sweep's impatient double press: the second came while the chat reported the first ("generation
    interrupted"), outside any handler of the chat's, and ended the session."""
    import signal
    import time

    from utils.chat.interrupts import BURST_S, at_prompt, interruptible, same_burst

    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interruptible(absorb_until_prompt=True):
                signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # as the stop is reported: the same request, not raised again
        at_prompt()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C at the prompt leaves again…
        assert same_burst()  # …unless it follows the stop at once
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        time.sleep(BURST_S)
        assert not same_burst()
        with interruptible(absorb_until_prompt=True):  # no press: the handler before it, as ever
            pass
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_end_tokens_are_the_vocabularys_own_and_an_unknown_turn_end_is_not_the_unk_id(session):
    from utils.chat.prompt_tokens import END_OF_TURN, stop_tokens, token_id

    tokenizer = session.tokenizer
    vocab = tokenizer.get_vocab()
    assert token_id(tokenizer, "<|im_end|>") == vocab["<|im_end|>"]
    assert token_id(tokenizer, "<end_of_turn>") is None  # the tokenizer maps it to <unk>: not a token of its own
    assert token_id(tokenizer, "<unk>") == vocab["<unk>"]
    expected = {vocab[t] for t in END_OF_TURN if t in vocab} | {tokenizer.eos_token_id}
    assert set(stop_tokens(tokenizer, session.target, chat=True)) == expected | {session.target.generation_config.eos_token_id}
    assert vocab["<|im_end|>"] not in stop_tokens(tokenizer, session.target, chat=False)


def test_help_and_usage_lines_say_what_is_accepted_and_what_runs():
    from utils.chat.commands import help_text

    def refusal(line):
        with pytest.raises(CommandError) as error:
            command, values = parse_command(line)
            command.run(Session.__new__(Session), *values)
        return str(error.value)

    greedy = refusal("/processor greedy 1 2")
    assert "usage: greedy [T] (1e-06 <= T <= 1e+06)" in greedy and "K" not in greedy  # its own parameters only
    assert "K an integer >= 1" in refusal("/processor topk 1") and "P" not in refusal("/processor topk 1")
    assert "0 < P <= 1" in refusal("/processor nucleus 1 x")
    assert "auto, 0 (all) or an integer >= 8" in refusal("/drafter_window -3")
    assert "fixed takes no value" in refusal("/draft_stop fixed 3")
    long = refusal("/length " + "9" * 5000)
    assert "(5004 characters)" not in long and "(5000 characters)" in long and len(long) < 200
    from utils.chat.settings import parse_window

    with pytest.raises(ValueError) as window:  # as --drafter-window reads it (the chat's command said it short)
        parse_window("x" * 5000)
    assert "(5000 characters)" in str(window.value) and len(str(window.value)) < 200
    settings = Settings()
    lines = {line.split()[0]: line for line in help_text(settings).splitlines()}
    assert lines["/draft_stop"].endswith("[auto = confidence 0.6]")  # cache off, greedy
    assert lines["/confidence"].endswith("[0.6]")  # what auto runs, not 0
    assert "off: back to auto" in lines["/adaptive"]
    settings.use_cache = True
    assert help_text(settings).count("[auto = confidence 0.9]") == 1
    settings.text_drafter = True  # a drafter of another tokenizer: its length follows acceptance
    lines = {line.split()[0]: line for line in help_text(settings).splitlines()}
    assert lines["/draft_stop"].endswith("[auto = adaptive]") and lines["/confidence"].endswith("[0]")


def test_the_older_adaptive_and_confidence_switches_compose_as_their_flags_do():
    """--adaptive --confidence 0.5 showed /adaptive [off], and /adaptive then dropped the confidence."""
    from sampling.draft_stop import DraftStopConfig
    from utils.chat.settings import draft_stop_from_flags

    session = bare_session(draft_stop=draft_stop_from_flags(None, True, 0.5))
    said = session.said

    def run(line):
        command, values = parse_command(line)
        command.run(session, *values)
        lines = {line.split()[0]: line for line in help_text(session.settings).splitlines()}
        return session.settings.draft_stop, lines["/adaptive"].endswith("[on]"), said[-1]

    assert {line.split()[0]: line for line in help_text(session.settings).splitlines()}["/adaptive"].endswith("[on]")
    assert run("/adaptive") == (DraftStopConfig("confidence", confidence=0.5), False,
                                "adaptive gamma: off (draft stop = confidence 0.5)")
    assert run("/adaptive")[:2] == (DraftStopConfig("confidence", confidence=0.5, adaptive=True), True)
    assert run("/confidence 0.7")[:2] == (DraftStopConfig("confidence", confidence=0.7, adaptive=True), True)
    assert run("/confidence 0") == (DraftStopConfig("adaptive"), True, "confidence = 0 (draft stop = adaptive)")
    assert run("/adaptive")[:2] == (DraftStopConfig("auto"), False)  # the adaptive rule alone: off is auto
    assert run("/confidence 0.4")[:2] == (DraftStopConfig("confidence", confidence=0.4), False)
    assert run("/confidence 0")[:2] == (DraftStopConfig("fixed"), False)
    assert run("/confidence -0") == (DraftStopConfig("fixed"), False, "confidence = 0 (draft stop = fixed)")


def test_a_drafter_whose_context_the_prompt_fills_is_named_when_it_drafts_nothing(tmp_path):
    """It drafted nothing, and the report said only `acceptance n/a`."""
    write_tiny_model(tmp_path / "t", seed=0, context=256)
    write_tiny_model(tmp_path / "d", seed=1, context=32)
    target, tokenizer = load_model(str(tmp_path / "t"), device="cpu", dtype="float32", progress=False)
    drafter, _ = load_model(str(tmp_path / "d"), device="cpu", dtype="float32", progress=False)
    chat = Session(target, drafter, tokenizer, Settings(length=4), json_mode=False)
    chat.out = io.StringIO()
    chat.settings.enabled = {g: g == "speculative" for g in chat.settings.enabled}
    note = "the drafter's context of 32 tokens is shorter than the sequence: it drafted nothing"
    chat.handle("w1 w2")
    assert note not in chat.out.getvalue()
    chat.handle(" ".join(["w1"] * 40))
    assert note in chat.out.getvalue()


def test_the_prefill_bar_is_drawn_on_a_terminal_only(monkeypatch):
    """In a file, its carriage returns and erasing spaces stayed, stuck to the answer's text."""
    from utils.chat import session as session_module

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(session_module.sys, "stderr", io.StringIO())
    assert session_module.prefill_bar(100).disable
    monkeypatch.setattr(session_module.sys, "stderr", Terminal())
    assert not session_module.prefill_bar(100).disable


def test_the_prefill_bar_promises_no_time_left(monkeypatch):
    # tqdm's estimate assumed every chunk as quick as the first: 1:22 left for a 17k-token prompt that took 6 minutes
    from utils.chat import session as session_module

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(session_module.sys, "stderr", Terminal())
    bar = session_module.prefill_bar(1000)
    bar.update(100)
    shown = str(bar)
    bar.close()
    assert "100/1000" in shown and "00:00" in shown and "<" not in shown and "tok/s" not in shown


def test_a_long_prompt_says_once_what_the_cache_off_and_a_kv_budget_cost(pair, monkeypatch):
    # a 17k-token prompt with the cache off (the default) gave no answer for an hour without a word
    from utils.chat import session as session_module

    target, drafter, tokenizer = pair
    chat = Session(target, drafter, tokenizer, Settings(length=4, use_cache=False, gamma=3))
    chat.out = io.StringIO()
    monkeypatch.setattr(session_module, "LONG_CACHE_OFF", 30)
    chat.answer("hi")
    assert "the cache is off" not in chat.out.getvalue()  # a short prompt: nothing to say
    chat.answer("hello " * 40)
    chat.answer("hello " * 40)
    assert re.findall(r"the cache is off: every pass of each answer reads all \d+ tokens again", chat.out.getvalue()) \
        and chat.out.getvalue().count("the cache is off") == 1  # once a session
    chat.settings.use_cache, chat.long_noted = True, set()
    monkeypatch.setattr(session_module, "kv_budget", lambda model: (4, 12))
    chat.answer("hello " * 40)
    out = chat.out.getvalue()
    assert out.count("the cache is off") == 1 and re.search(r"the prompt's \d+ tokens exceed the KV budget of 16", out)


def test_a_chat_template_that_fails_is_named_with_the_way_out(pair):
    """A GGUF whose template does not parse said only `error: TemplateSyntaxError: unexpected '%'`."""
    import copy

    target, drafter, tokenizer = pair
    for template, kind in [("{% if %}", "TemplateSyntaxError"),
                           ("{{ raise_exception('roles must alternate') }}", "TemplateError")]:
        broken = copy.deepcopy(tokenizer)
        broken.chat_template = template
        chat = Session(target, drafter, broken, Settings(length=2))
        chat.out = io.StringIO()
        with pytest.raises(CommandError, match=rf"^the model's chat template fails \({kind}: .*\); /chat \(--no-chat\) "
                                               "reads prompts as plain text$"):
            chat.answer("hello")
        chat.settings.chat = False
        assert chat.answer("hello")[0].error is None  # the way out works


def test_the_drafter_alone_is_shown_in_its_own_words_where_its_vocabulary_goes_past_the_targets(tmp_path):
    """A sweep found a drafter with the target's vocabulary and 26 words more accepted as the same vocabulary (right)
    and its answer alone decoded by the target's tokenizer: ids past the target's are no text there, so "" was shown
    for 8 tokens."""
    write_tiny_model(tmp_path / "target")
    write_tiny_model(tmp_path / "drafter", extra_words=26)
    target, tokenizer = load_model(str(tmp_path / "target"), device="cpu", dtype="float32", progress=False)
    drafter, drafter_tokenizer = load_model(str(tmp_path / "drafter"), device="cpu", dtype="float32", progress=False)
    chat = Session(target, drafter, tokenizer, Settings(length=4), drafter_own_tokenizer=drafter_tokenizer)
    chat.out = io.StringIO()
    report = chat.run_block("drafter", [4, 5, 6], [1], baseline=None)
    assert report.token_ids and min(report.token_ids) >= len(tokenizer)  # the words only the drafter has
    assert report.text == drafter_tokenizer.decode(report.token_ids) and re.fullmatch(r"(x[01] ?)+", report.text)
    assert chat.run_block("target", [4, 5, 6], [1], baseline=None).text  # the target's own, as before


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colours_follow_the_stream_written_to_and_term_dumb(monkeypatch):
    """A sweep: TERM=dumb (Emacs' shell) got escape sequences, and colours were decided by stdout for text on
    stderr (--json on a terminal, its stdout in a file)."""
    from utils.printing import paint

    for name in ("NO_COLOR", "FORCE_COLOR", "TERM"):
        monkeypatch.delenv(name, raising=False)
    terminal, log = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", log)
    assert paint("x", "red", terminal) != "x" and paint("x", "red") == "x" == paint("x", "red", log)
    monkeypatch.setenv("TERM", "dumb")
    assert paint("x", "red", terminal) == "x"
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert paint("x", "red", terminal) != "x"


def test_clear_writes_no_escape_sequence_into_a_file_or_pipe(session, monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "TERM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FORCE_COLOR", "1")  # colours forced into a file: still no terminal to clear
    monkeypatch.setattr(session, "out", io.StringIO())
    session.clear_screen()
    assert "\033" not in session.out.getvalue() and "no terminal that clears" in session.out.getvalue()
    monkeypatch.delenv("FORCE_COLOR")
    monkeypatch.setenv("NO_COLOR", "1")  # no colours, but a terminal: it clears
    monkeypatch.setattr(session, "out", Terminal())
    session.clear_screen()
    assert session.out.getvalue() == "\033[2J\033[H"
    monkeypatch.delenv("NO_COLOR")
    session.error("bad")
    assert "\033[31mbad" in session.out.getvalue()  # its errors coloured by where they go, not by stdout


def test_a_failed_target_answer_is_not_called_target_off(tmp_path, monkeypatch):
    """The target's answer failing (out of memory) left the others' speedups "n/a (/target is off)" with /target
    on."""
    chat = tiny_session(tmp_path / "model", length=4)
    real = chat.generate

    def generate(name, *args):
        if name == "target":
            raise MemoryError("out of memory")
        return real(name, *args)

    monkeypatch.setattr(chat, "generate", generate)
    chat.handle("hello world")
    said = chat.out.getvalue()
    assert "target failed: MemoryError: out of memory" in said
    assert "speedup n/a (the target's answer failed)" in said and "/target is off" not in said
    chat.out = io.StringIO()
    chat.handle("/target")
    chat.handle("hello world")
    assert "speedup n/a (/target is off)" in chat.out.getvalue()


def test_help_does_not_call_a_cap_whose_timing_failed_timed(tmp_path, monkeypatch):
    from sampling import draft_cap

    def timing_fails(*args, **kwargs):
        raise MemoryError("out of memory")

    monkeypatch.setattr(draft_cap, "load_or_measure", timing_fails)
    chat = tiny_session(tmp_path / "model", length=4, use_cache=True)  # greedy, auto: a timed cap
    chat.handle("hello world")
    assert "the draft cap could not be timed" in chat.out.getvalue()
    assert f"auto = {draft_cap.FALLBACK_CAP} (the timing failed)" in help_text(chat.settings)


# ---- the command table's arguments at their edges (found by a mutation review of utils/chat/) ----


def bare_session(**settings) -> Session:
    """A Session with settings and a list of what it said: enough for the commands that only edit a setting."""
    chat = Session.__new__(Session)
    chat.settings, chat.said = Settings(**settings), []
    chat.say = chat.said.append
    return chat


def test_each_integer_argument_takes_its_bounds_and_refuses_one_past_them():
    # the rules /help prints are the ranges: each bound itself is accepted, one past it refused
    for line, value in [("/length 1", 1), ("/top_k_filler 1", 1), ("/draft_vocab 0", 0),
                        ("/set_ngramstorage basic 2", 2), ("/set_ngramstorage onelevel 16", 16),
                        ("/seed -9223372036854775808", -(2**63)), ("/seed 18446744073709551615", 2**64 - 1),
                        ("/confidence 0", 0.0), ("/drafter_window 0", 0), ("/gamma 1", 1)]:
        assert parse_command(line)[1][-1] == value, line
    for line in ("/top_k_filler 0", "/draft_vocab -1", "/set_ngramstorage basic 1", "/set_ngramstorage basic 17",
                 "/seed -9223372036854775809", "/seed 18446744073709551616", "/confidence 1", "/drafter_window -1"):
        with pytest.raises(CommandError, match="must be"):
            parse_command(line)


def test_the_storage_kind_is_read_in_any_case_and_named_by_place():
    # the kind goes on to make_storage and /help as typed: "BASIC" would be a kind no storage knows
    assert parse_command("/set_ngramstorage BASIC 3")[1] == ["basic", 3]
    with pytest.raises(CommandError, match=r"^/set_ngramstorage: argument 1 must be basic or onelevel, got 'trie'$"):
        parse_command("/set_ngramstorage trie 3")


def test_a_command_given_more_words_than_it_takes_is_refused_with_its_usage():
    # an extra word was a typo or a misunderstanding: running the command without it would hide either
    for line, usage in [("/debug now", "usage: /debug (no arguments)"),
                        ("/length 5 6", "usage: /length N (N: an integer >= 1)"),
                        ("/set_ngramstorage basic 3 4", "usage: /set_ngramstorage basic|onelevel N")]:
        with pytest.raises(CommandError) as error:
            parse_command(line)
        assert str(error.value).startswith(usage), line


def test_free_form_commands_show_their_words_in_help_and_take_them_whole():
    lines = {line.split()[0]: line for line in help_text(Settings()).splitlines()}
    assert "/draft_stop RULE [X] " in lines["/draft_stop"]
    assert "/processor NAME ARGS… " in lines["/processor"] and "/file PATH " in lines["/file"]
    assert parse_command("/processor topk 0.8 40")[1] == [["topk", "0.8", "40"]]
    assert parse_command("/file  a  b.txt ")[1] == ["a  b.txt"]  # a path's runs of spaces, as typed


def test_help_lines_up_every_commands_text_in_one_column():
    # the column is the longest usage's: a narrower one shifts each line's text by its usage's length
    from utils.chat.commands import COMMANDS

    lines = help_text(Settings()).splitlines()
    assert len(lines) == len(COMMANDS) and len({line.index(c.help) for line, c in zip(lines, COMMANDS)}) == 1


def test_generator_toggles_flip_their_own_generator_only():
    chat = bare_session()
    command, _ = parse_command("/ngram")
    command.run(chat)
    assert chat.settings.enabled == {"target": True, "speculative": True, "ngram": False, "drafter": True}
    assert chat.said[-1] == "ngram: off"
    command.run(chat)
    assert chat.settings.enabled["ngram"] and chat.said[-1] == "ngram: on"


def test_generators_flag_names_who_answers_and_refuses_none():
    from utils.chat.settings import parse_generators

    assert parse_generators(" Target , ngram") == {"target": True, "speculative": False, "ngram": True, "drafter": False}
    for text, message in [(" , ", "no generator named"), ("", "no generator named"), ("target,beam", "unknown 'beam'")]:
        with pytest.raises(ValueError, match=message):  # nothing enabled would answer every prompt with nothing
            parse_generators(text)


def test_processors_parse_their_optional_and_required_values_and_describe_them_as_typed():
    from utils.chat.settings import describe_processor, parse_processor

    assert describe_processor(parse_processor(["greedy"])) == "greedy 1"  # T is optional for greedy alone
    assert describe_processor(parse_processor(["TopK", "0.8", "40"])) == "topk 0.8 40"
    assert describe_processor(parse_processor(["nucleus", "0.5", "0.25"])) == "nucleus 0.5 0.25"
    for words in (["multinomial"], ["topk", "0.8", "x"], ["topk", "0.8", "4.5"]):
        with pytest.raises(ValueError, match="^usage: "):
            parse_processor(words)


def test_drafter_windows_read_and_describe_all_auto_and_a_number():
    from utils.chat.settings import describe_window, parse_window

    assert parse_window(" AUTO ") is None and parse_window("0") == 0 and parse_window("24") == 24
    for bad in ("all", "-1", "2.5"):
        with pytest.raises(ValueError, match="a drafter window is auto, 0 \\(all\\) or an integer >= 8"):
            parse_window(bad)
    assert describe_window(0) == "0 (the drafter reads everything)"
    assert describe_window(24) == "24 (4 sinks + the 20 latest positions)"


def test_an_argument_of_forty_characters_is_shown_whole():
    # `shown` cuts only what is longer than its limit: a 40-character argument is quoted as typed
    from utils.chat.settings import shown

    assert shown("x" * 40) == repr("x" * 40) and shown("x" * 41) == f"{'x' * 40!r}… (41 characters)"


def test_a_text_drafter_under_the_adaptive_rule_keeps_an_adaptive_length():
    # a drafter of another tokenizer has no distribution to read: adaptive (as auto) follows acceptance, not fixed
    from sampling.draft_stop import DraftStopConfig
    from utils.chat.settings import draft_stop_now

    settings = Settings(text_drafter=True, draft_stop=DraftStopConfig("adaptive"))
    assert draft_stop_now(settings) == DraftStopConfig("adaptive")
    settings.draft_stop = DraftStopConfig("entropy", entropy_bound=0.4)
    assert draft_stop_now(settings) == DraftStopConfig("fixed")


def test_an_unknown_commands_hint_names_every_command_it_begins_or_a_close_spelling_never_a_guess_among_several():
    # "/c" begins /clear, /cache, /chat and /confidence: naming one of them would be a guess, so all are named
    for line, hint in [("/c", "/cache or /chat or /clear or /confidence"), ("/r", "/reset or /reset_in_between"),
                       ("/draft_", "/draft_stop or /draft_vocab"), ("/gam 3", "/gamma"), ("/gama", "/gamma"),
                       ("/speculatve", "/speculative"), ("/xyzzy", None), ("/sead", "/seed"), ("/generators", None)]:
        with pytest.raises(CommandError) as error:
            parse_command(line)
        said = str(error.value)
        assert said.endswith("(/help lists them)") and (f"did you mean {hint}?" in said if hint else "did you mean" not in said), line


def test_refused_draft_stop_and_window_values_are_one_line_and_change_nothing(session):
    # both are checked against the drafter when given, not at the next answer (a missing head, a window below
    # its sinks), and the refusal is the command's one line, not a ValueError out of the REPL
    before = (session.settings.draft_stop, session.settings.drafter_window)
    for line, message in [("/draft_stop learned /no/head.pt", "^/draft_stop: no acceptance head at /no/head.pt"),
                          ("/drafter_window 3", "^/drafter_window: a drafter window must be at least 8 positions")]:
        command, values = parse_command(line)
        with pytest.raises(CommandError, match=message):
            command.run(session, *values)
    assert (session.settings.draft_stop, session.settings.drafter_window) == before


def test_help_shows_what_a_rule_runs_only_where_it_differs_from_the_rule():
    from sampling.draft_stop import DraftStopConfig

    lines = {line.split()[0]: line for line in help_text(Settings(draft_stop=DraftStopConfig("fixed"))).splitlines()}
    assert lines["/draft_stop"].endswith("[fixed]")  # not "[fixed = fixed]"


# ---- what the session keeps, drops and says at the edges of its rules ----


def conversing_session(limit: int, length: int, history: list[dict]) -> Session:
    """A bare session in chat mode whose every message costs 10 tokens and every prompt word 1: fit_context's
    arithmetic can be followed by hand. What it says is in `.said`."""
    from types import SimpleNamespace

    chat = bare_session(length=length)
    chat.tokenizer = SimpleNamespace(chat_template="a template")
    chat.history, chat.limit, chat.length_noted, chat.out = list(history), limit, None, io.StringIO()
    chat.encode = lambda prompt, history=None: [0] * (len(prompt.split()) + 10 * len(
        [m for m in (chat.history if history is None else history) if m["role"] != "system"]))
    return chat


TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "u1"},
         {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
         {"role": "assistant", "content": "a2"}]


def test_a_prompt_and_a_full_answer_that_just_fit_keep_the_whole_conversation():
    # 40 tokens of turns + a 10-word prompt + an answer of 10 fill a context of 60 exactly: nothing to drop
    chat = conversing_session(limit=60, length=10, history=TURNS)
    ids, history = chat.fit_context(" ".join(["w"] * 10))
    assert len(ids) == 50 and history == TURNS and "dropped" not in " ".join(chat.said)


def test_a_dropped_turn_takes_its_reply_with_it():
    # one word more drops the oldest exchange whole: a reply left without its question would read as the
    # assistant speaking first, and the system prompt always stays
    chat = conversing_session(limit=60, length=10, history=TURNS)
    _, history = chat.fit_context(" ".join(["w"] * 11))
    assert history == [TURNS[0], *TURNS[3:]]
    assert "dropped the 1 oldest turn of the conversation" in " ".join(chat.said)


def test_a_prompt_exactly_as_long_as_the_context_is_refused():
    # a prompt that fills the context leaves no position for even one answered token
    chat = conversing_session(limit=60, length=10, history=[])
    assert len(chat.fit_context(" ".join(["w"] * 59))[0]) == 59
    with pytest.raises(CommandError, match="the prompt is 60 tokens long; the target's context is 60"):
        chat.fit_context(" ".join(["w"] * 60))


def test_that_no_earlier_turn_fits_is_said_once_per_length():
    # said at every turn, the line would bury the answers of a chat run at a long /length
    chat = conversing_session(limit=60, length=10, history=TURNS)
    for _ in range(2):
        chat.fit_context(" ".join(["w"] * 45))
    assert " ".join(chat.said).count("no earlier turn fits beside an answer of /length 10") == 1
    chat.settings.length = 9
    chat.fit_context(" ".join(["w"] * 45))
    assert " ".join(chat.said).count("no earlier turn fits beside an answer of /length 9") == 1


def test_without_a_chat_template_chat_mode_turns_off_but_not_on():
    # a tokenizer without a template has no conversation to read: chat on is a setting that does nothing, so it may
    # be turned off (and stays off), never on
    from types import SimpleNamespace

    chat = bare_session(chat=True)
    chat.tokenizer = SimpleNamespace(chat_template=None)
    assert not chat.conversing
    chat.toggle_chat()
    assert chat.settings.chat is False and chat.said[-1] == "chat: off"
    with pytest.raises(CommandError, match="no chat template"):
        chat.toggle_chat()
    assert chat.settings.chat is False


def test_a_command_line_is_no_answer():
    # the REPL tells "generation interrupted" from "interrupted" by `answering`: a command after an answer must not
    # inherit the answer's flag; and a command answers with no report
    chat = bare_session()
    chat.answering = True
    assert chat.handle("/help") == [] and chat.answering is False


def test_a_new_conversation_forgets_the_turns_and_the_caches_read_with_them():
    chat = bare_session()
    chat.history, chat.kept = list(TURNS), {"target": object()}
    chat.reset_conversation()
    assert chat.history == [] and chat.kept == {} and chat.said[-1] == "new conversation"


def test_the_long_prompt_notes_start_at_their_thresholds(monkeypatch):
    # a prompt of exactly LONG_CACHE_OFF tokens is long, and a prompt that just fits the KV budget hides nothing
    from utils.chat import session as session_module

    monkeypatch.setattr(session_module, "kv_budget", lambda model: (4, 20))
    monkeypatch.setattr(session_module, "LONG_CACHE_OFF", 20)
    chat = bare_session(use_cache=False)
    chat.target, chat.long_noted, chat.out = None, set(), io.StringIO()
    chat.note_long_prompt(19)  # under both: nothing
    assert chat.said == []
    chat.note_long_prompt(20)
    chat.note_long_prompt(24)  # the whole budget, and no more: nothing hidden
    assert len(chat.said) == 1 and "the cache is off: every pass of each answer reads all 20 tokens" in chat.said[0]
    chat.note_long_prompt(25)
    chat.note_long_prompt(30)
    assert len(chat.said) == 2 and "the prompt's 25 tokens exceed the KV budget of 24" in chat.said[1]  # once each


def test_the_context_note_follows_where_the_loop_stops(monkeypatch):
    # the loop ends a sequence one past the context: only then did the context, not the answer's length or an end
    # token, stop it
    chat = bare_session(length=10)
    chat.limit_of = lambda name: 20
    assert not chat.stopped_by_context("target", 15, [5] * 5, [1])  # 20 positions: within the context
    assert chat.stopped_by_context("target", 15, [5] * 6, [1])
    assert not chat.stopped_by_context("target", 15, [5] * 5 + [1], [1])  # ended on its own
    assert not chat.stopped_by_context("target", 15, [5] * 10, [1])  # the whole /length was answered


def test_a_drafter_filled_by_the_prompt_alone_is_outgrown_from_its_context_length(monkeypatch):
    from utils.chat import session as session_module

    monkeypatch.setattr(session_module, "context_limit", lambda model: 8)
    chat = bare_session()
    chat.drafter, chat.drafter_tokenizer = None, None
    assert chat.drafter_outgrown([0] * 7) is None and chat.drafter_outgrown([0] * 8) == 8


def test_caches_read_under_an_old_setting_are_dropped(session, monkeypatch):
    # a cache kept across a change of the cache or the drafter's window would be read as if built for the new one
    monkeypatch.setattr(session, "kept", {"target": object(), "speculative": object()})
    monkeypatch.setattr(session.settings, "drafter_window", session.settings.drafter_window)
    session.set_drafter_window(None)
    assert list(session.kept) == ["target"]  # the target's cache does not depend on the drafter's window
    monkeypatch.setattr(session.settings, "use_cache", True)
    session.toggle_cache()
    assert session.settings.use_cache is False and session.kept == {}


def test_a_generator_that_fails_drops_its_own_kept_caches_only(session, monkeypatch):
    # a pass that raised may have left its cache half written: the next turn reads the prompt afresh
    monkeypatch.setattr(session, "kept", {"target": object(), "ngram": object()})
    monkeypatch.setattr(session, "generate", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    assert session.run_block("target", [4, 5, 6], [1], baseline=None).error == "RuntimeError: boom"
    assert list(session.kept) == ["ngram"]


def test_runners_are_kept_with_the_cache_only_and_draw_their_bar_where_it_is_seen(session, monkeypatch):
    # cache off, a kept runner keeps nothing worth its memory; the drafter reads the prompt after the first token is
    # shown (a bar would overwrite it), and in --json mode no bar is drawn
    from utils.chat.session import prefill_bar

    monkeypatch.setattr(session, "kept", {})
    assert not session.settings.use_cache
    target, drafter = session.runners("speculative")
    assert target.progress is prefill_bar and drafter.progress is None and session.kept == {}
    monkeypatch.setattr(session, "json_mode", True)
    assert session.runners("target").progress is None


def test_the_speculative_rule_is_kept_while_its_setting_stays(session, monkeypatch):
    # a learned rule keeps what it measured across prompts: built anew each time it would forget it
    monkeypatch.setattr(session, "stop_rule", None)
    rule = session.draft_stop()
    assert session.draft_stop() is rule


def test_debug_colours_the_drafting_generators_only(session, monkeypatch):
    # the target alone drafts nothing: its debug rounds would be noise around plain text
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setattr(session.settings, "debug", True)
    monkeypatch.setattr(session, "out", io.StringIO())

    def generate(name, ids, stop, on_round, gamma):
        on_round(Round(drafts=[], accepted=0, tokens=[5, 6]))
        return GenerationResult(tokens=[5, 6], target_calls=2)

    monkeypatch.setattr(session, "generate", generate)
    session.run_block("target", [4, 5, 6], [1], baseline=None)
    assert session.out.getvalue().splitlines()[1] == "w1 w2"


def test_the_cache_stays_off_where_the_drafter_alone_cannot_keep_one(monkeypatch):
    # a recurrent drafter's state only grows: a cache rolled back under it would draft from a state past the sequence
    from utils.chat import session as session_module

    target, drafter = object(), object()
    monkeypatch.setattr(session_module, "kv_policy", lambda model: "full")
    monkeypatch.setattr(session_module, "cache_refusal",
                        lambda model: "a recurrent state cannot be rolled back" if model is drafter else None)
    chat = bare_session(use_cache=False)
    chat.target, chat.drafter, chat.kept = target, drafter, {}
    assert chat.cache_refusal() == "a recurrent state cannot be rolled back"
    with pytest.raises(CommandError, match="^the cache stays off: a recurrent state cannot be rolled back$"):
        chat.toggle_cache()
    assert chat.settings.use_cache is False and chat.said == []
    chat.settings.use_cache = True  # on anyway (a library caller): turning it off is never refused
    chat.error = chat.said.append
    chat.toggle_cache()
    assert chat.settings.use_cache is False and chat.said == ["cache: off"]


def test_a_new_draft_head_has_the_draft_cap_timed_again(monkeypatch):
    # the cap was chosen from what a drafter step cost with the old head: a 4k-row head costs a fraction of a whole
    # one, so the old cap would draft too few tokens (or too many) for the new
    from utils.models import draft_vocab

    monkeypatch.setattr(draft_vocab, "use_draft_vocab", lambda drafter, tokenizer, size: "")
    monkeypatch.setattr(draft_vocab, "shortlisted", lambda drafter: True)
    chat = bare_session(measured_cap=5)
    chat.target, chat.drafter, chat.tokenizer, chat.drafter_tokenizer = object(), object(), None, None
    chat.set_draft_vocab(4096)
    assert chat.settings.measured_cap is None and chat.settings.draft_vocab == 4096
    assert chat.said == ["draft vocab = 4096"]


def test_an_empty_ngram_cache_file_is_an_empty_storage_kept_across_prompts(session, monkeypatch, tmp_path):
    # `touch chat.ngram` names where to keep NASD's storage: it is no damaged file to refuse, and a storage that is
    # saved after every answer must not be replaced by a fresh one at each prompt
    path = tmp_path / "chat.ngram"
    path.touch()
    for name in ("ngram_cache", "fingerprint", "storage", "out"):
        monkeypatch.setattr(session, name, getattr(session, name))
    monkeypatch.setattr(session.settings, "reset_in_between", True)
    session.out = io.StringIO()
    session.use_ngram_cache(str(path))
    assert session.ngram_cache == str(path) and session.settings.reset_in_between is False
    assert session.out.getvalue() == ""  # nothing to load, and nothing refused
    damaged = tmp_path / "damaged.ngram"
    damaged.write_bytes(b"not an n-gram cache")
    session.ngram_cache = None
    session.use_ngram_cache(str(damaged))  # one line; the file is left as it is, never saved over
    assert "will not overwrite the file" in session.out.getvalue() and session.ngram_cache is None
    assert "loaded" not in session.out.getvalue()


def test_a_reader_gone_mid_answer_ends_the_prompt_rather_than_failing_one_generator(session, monkeypatch):
    # `… | head -1`: nothing more can be shown, so no other generator should start, nor an error line be written
    monkeypatch.setattr(session, "out", io.StringIO())
    monkeypatch.setattr(session, "generate", lambda *a: (_ for _ in ()).throw(BrokenPipeError(32, "Broken pipe")))
    with pytest.raises(BrokenPipeError):
        session.run_block("target", [4, 5, 6], [1], baseline=None)
    assert "failed" not in session.out.getvalue()


def test_a_loaded_ngram_cache_sets_the_storage_kind_and_n_it_was_saved_with(session, monkeypatch, tmp_path):
    # /help and a later /reset_in_between build storages from these settings: left at the defaults, they would name
    # (and make) a storage of another kind than the one NASD reads
    from ngram_assisted.ngram_cache import KINDS, save_storage, tokenizer_fingerprint

    path = tmp_path / "onelevel.ngram"
    save_storage(path, KINDS["onelevel"](5, session.target.config.vocab_size), tokenizer_fingerprint(session.tokenizer))
    for name in ("ngram_cache", "fingerprint", "storage", "out"):
        monkeypatch.setattr(session, name, getattr(session, name))
    for name in ("reset_in_between", "ngram_kind", "ngram_n"):
        monkeypatch.setattr(session.settings, name, getattr(session.settings, name))
    session.out = io.StringIO()
    session.use_ngram_cache(str(path))
    assert (session.settings.ngram_kind, session.settings.ngram_n) == ("onelevel", 5)
    assert f"n-gram cache: 0 contexts loaded from {path}" in session.out.getvalue()


def test_the_drafters_answer_is_held_to_the_drafters_own_context():
    # the drafter generator runs the drafter alone: its answer stops at the drafter's context, not the target's, and
    # the note must name that context (a shorter drafter's answer ending early would otherwise go unexplained)
    from types import SimpleNamespace

    chat = bare_session(length=40)
    chat.target = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    chat.drafter = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=32))
    assert [chat.limit_of(name) for name in ("target", "speculative", "ngram", "drafter")] == [64, 64, 64, 32]
    tokens = [7] * 13  # a 20-token prompt and 13 new tokens: past 32, within 64 and the length of 40
    assert chat.stopped_by_context("drafter", 20, tokens, stop=[2])
    assert not chat.stopped_by_context("target", 20, tokens, stop=[2])
