"""`/gamma auto`: the cap chosen from timed passes, the timing kept in the cache folder and out of an answer's
figures, and used only where its model holds (sampling/draft_cap.py)."""

import copy
import json
import time
import types

import pytest

from cli_models import tiny_session
from sampling import draft_cap
from sampling.draft_cap import PassTimes, applies, best_cap, load_or_measure, round_rate
from sampling.draft_stop import DraftStopConfig
from utils.chat.commands import CommandError, parse_command
from utils.logits_processor import GreedyProcessor, NucleusProcessor


def costs(first_ms: float, per_row_ms: float, draft_ms: float) -> PassTimes:
    return PassTimes(draft_ms / 1e3, {w: (first_ms + per_row_ms * (w - 1)) / 1e3 for w in range(2, 14)})


def test_the_cap_follows_what_a_wider_pass_costs():
    # rows nearly free (a GPU, AMX): every sure draft pays, up to the widest cap weighed
    assert best_cap(costs(40, 0.5, 1)) == max(draft_cap.CAPS)
    # every row as dear as a pass of its own: the shortest
    assert best_cap(costs(40, 40, 10)) == min(draft_cap.CAPS)
    # the forty-third pass's AMX Xeon (3-13 rows; RESULTS.md): 12, with 6 about 7% behind
    xeon = PassTimes(0.0136, {3: 0.0497, 5: 0.0585, 7: 0.0660, 9: 0.0762, 11: 0.0798, 13: 0.0874})
    assert best_cap(xeon) == 12
    assert 0.92 < round_rate(xeon, 6) / round_rate(xeon, 12) < 0.94
    # the Zen 3 of the sixty-second pass (3-5 rows): 3, which the model weighs between 2 and 4
    zen3 = PassTimes(0.0251, {3: 0.0829, 4: 0.0963, 5: 0.1183})
    assert best_cap(zen3) == 3
    # the model by hand: a = 0.5, 2 drafts -> 1 + 0.5 + 0.25 tokens over 2 steps and a 3-row pass
    assert round_rate(PassTimes(0.1, {3: 0.3}), 2, a=0.5) == pytest.approx(1.75 / 0.5)


def test_only_strict_greedy_confidence_gets_a_measured_cap():
    assert applies(DraftStopConfig("confidence", confidence=0.9), greedy=True)
    assert applies(DraftStopConfig("confidence", confidence=0.95), greedy=True)
    assert not applies(DraftStopConfig("confidence", confidence=0.6), greedy=True)  # lets wrong drafts through
    assert not applies(DraftStopConfig("confidence", confidence=0.9), greedy=False)  # not measured
    assert not applies(DraftStopConfig("confidence", confidence=0.9, adaptive=True), greedy=True)
    for rule in ("fixed", "adaptive", "entropy", "learned"):
        assert not applies(DraftStopConfig(rule), greedy=True)


def test_the_chat_times_its_cap_with_the_cache_on_only():
    """The cap model prices one-row passes that grow to a few rows: with the cache off every pass feeds the whole
    sequence, so `auto` stays FALLBACK_CAP there, whatever the rule."""
    from utils.chat.settings import Settings, measures_cap

    strict = DraftStopConfig("confidence", confidence=0.9)
    assert measures_cap(Settings(use_cache=True, draft_stop=strict))
    assert not measures_cap(Settings(use_cache=False, draft_stop=strict))
    assert not measures_cap(Settings(use_cache=True, draft_stop=strict, gamma=4))


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return tiny_session(tmp_path_factory.mktemp("model"), length=6)


def test_measure_times_every_width_and_leaves_the_models_as_they_were(chat):
    measured = draft_cap.measure(chat.target, chat.drafter, caps=(2, 4), turns=1)
    assert set(measured.verify) == {3, 5} and measured.draft > 0 and min(measured.verify.values()) > 0
    assert best_cap(measured) in (2, 4)
    # as benchmarks.draft_replay times its rounds: widths from 1, a longer cache, samples of several passes
    replayed = draft_cap.measure(chat.target, chat.drafter, caps=range(2), turns=1, held=8, passes=2)
    assert set(replayed.verify) == {1, 2} and replayed.draft > 0 and min(replayed.verify.values()) > 0


def test_the_timing_is_kept_in_the_cache_folder(chat, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    timed, notes = [], []
    monkeypatch.setattr(draft_cap, "measure", lambda t, d: timed.append(1) or costs(40, 0.5, 1))
    assert load_or_measure(chat.target, chat.drafter, note=notes.append)[0] == 12
    assert len(timed) == 1 and len(notes) == 1 and "timing this machine's verification passes" in notes[0]
    saved = list(tmp_path.glob("draft-cap-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["verify"]["13"] == pytest.approx(0.046)
    cap, kept = load_or_measure(chat.target, chat.drafter, note=notes.append)  # from the file: no timing
    assert cap == 12 and kept.verify[13] == pytest.approx(0.046) and len(timed) == 1 and len(notes) == 1
    saved[0].write_text("{not json")  # a damaged file is timed again, not an error
    assert load_or_measure(chat.target, chat.drafter)[0] == 12 and len(timed) == 2
    # another model (here: another dtype of every tensor) is another entry
    other = types.SimpleNamespace(config=chat.target.config, device=chat.target.device,
                                  named_modules=chat.target.named_modules, named_buffers=lambda: [],
                                  named_parameters=lambda: [(n, p.half()) for n, p in chat.target.named_parameters()])
    assert draft_cap.cache_key(other, chat.drafter) != draft_cap.cache_key(chat.target, chat.drafter)
    # the same model read from elsewhere (another cache folder) is the same entry
    moved = copy.deepcopy(chat.target.config)
    moved._name_or_path = "/elsewhere/model"
    same = types.SimpleNamespace(config=moved, device=chat.target.device, named_modules=chat.target.named_modules,
                                 named_buffers=chat.target.named_buffers, named_parameters=chat.target.named_parameters)
    assert draft_cap.cache_key(same, chat.drafter) == draft_cap.cache_key(chat.target, chat.drafter)
    # a folder that refuses the file: timed, used, and said so
    monkeypatch.setattr(draft_cap, "write_in_one_step", lambda path, data: False)
    saved[0].unlink()
    assert load_or_measure(chat.target, chat.drafter, note=notes.append)[0] == 12 and len(timed) == 3
    assert notes[-1] == f"(the timing could not be saved in {tmp_path}: it runs again at the next start)"


def test_the_chat_times_once_outside_the_answers_clock(chat, monkeypatch):
    s = chat.settings
    assert s.gamma is None and not s.use_cache
    assert chat.gamma_for("speculative") == draft_cap.FALLBACK_CAP  # cache off: no timing
    clock = {"offset": 0.0}
    monkeypatch.setattr("utils.chat.session.time",
                        types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + clock["offset"]))
    calls = []

    def timed(target, drafter, note):
        calls.append(1)
        clock["offset"] += 1000.0  # seconds of timing, were they inside an answer's
        note("(timing ...)")
        return 3, costs(40, 40, 10)

    monkeypatch.setattr(draft_cap, "load_or_measure", timed)
    parse_command("/cache")[0].run(chat)
    try:
        assert "[auto = chosen at the next speculative answer]" in help_line(chat)
        reports = chat.answer("hello")
        speculative = next(r for r in reports if r.generator == "speculative")
        assert (speculative.draft_stop, speculative.gamma) == ("confidence 0.9", 3)
        assert "(confidence 0.9, at most 3)" in chat.out.getvalue()
        assert all(r.seconds < 1000 for r in reports) and len(calls) == 1 and "(timing ...)" in chat.out.getvalue()
        assert "[auto = 3 (timed here)]" in help_line(chat)
        chat.answer("hello again")
        assert len(calls) == 1  # once a session (and once a machine: the cache folder)
        assert chat.gamma_for("ngram") == draft_cap.FALLBACK_CAP  # NASD's drafts are not the model's
        s.processor = NucleusProcessor(0.7, 0.9)
        assert chat.gamma_for("speculative") == draft_cap.FALLBACK_CAP and "[auto = 6]" in help_line(chat)
    finally:
        s.processor = GreedyProcessor()
        parse_command("/cache")[0].run(chat)


def help_line(chat) -> str:
    from utils.chat.commands import help_text

    return next(line for line in help_text(chat.settings).splitlines() if line.strip().startswith("/gamma"))


def test_gamma_takes_a_number_or_auto(chat):
    command, values = parse_command("/gamma 4")
    command.run(chat, *values)
    assert chat.settings.gamma == 4 and chat.gamma_for("speculative") == 4 and chat.gamma_for("ngram") == 4
    command, values = parse_command("/gamma Auto")
    command.run(chat, *values)
    assert chat.settings.gamma is None and "gamma = auto = 6" in chat.out.getvalue()
    for bad in ("/gamma 0", "/gamma -2", "/gamma 2.5", "/gamma automatic"):
        with pytest.raises(CommandError, match=r"/gamma: N must be an integer >= 1, or auto"):
            parse_command(bad)


def test_a_timing_that_fails_leaves_the_answer_and_six(chat, monkeypatch):
    def broken(target, drafter, note):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(draft_cap, "load_or_measure", broken)
    parse_command("/cache")[0].run(chat)
    measured = chat.settings.measured_cap
    chat.settings.measured_cap = None
    try:
        reports = chat.answer("hello")
        assert [r.error for r in reports] == [None] * len(reports) and len(reports) == 4
        assert next(r for r in reports if r.generator == "speculative").gamma == draft_cap.FALLBACK_CAP
        assert ("the draft cap could not be timed (RuntimeError: CUDA out of memory); gamma auto is 6 in this "
                "session") in chat.out.getvalue()
    finally:
        chat.settings.measured_cap = measured
        parse_command("/cache")[0].run(chat)


def test_a_context_too_short_to_time_is_refused_and_bad_files_are_timed_again(chat, tmp_path, monkeypatch):
    from utils.model_runner import context_limit

    limit = context_limit(chat.target)
    with pytest.raises(ValueError, match=f"a context of {limit} positions is too short to time passes"):
        draft_cap.measure(chat.target, chat.drafter, caps=(limit,), turns=1)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    timed = []
    monkeypatch.setattr(draft_cap, "measure", lambda t, d: timed.append(1) or costs(40, 0.5, 1))
    load_or_measure(chat.target, chat.drafter)
    saved = next(tmp_path.glob("draft-cap-*.json"))
    widths = {str(c + 1): 0.05 for c in draft_cap.CAPS}
    for bad in ({"draft": 0.0, "verify": widths}, {"draft": 0.01, "verify": {**widths, "3": "nan"}},
                {"draft": 0.01, "verify": {}}, {"draft": 0.01, "verify": {"3": 0.05}}):
        saved.write_text(json.dumps(bad))
        assert load_or_measure(chat.target, chat.drafter)[0] == 12
    assert len(timed) == 5


def test_a_start_that_waited_for_another_ones_timing_reads_it(chat, tmp_path, monkeypatch):
    """Two starts at once timed the passes on a machine the other was loading: one times, the other waits
    (`one_start_at_a_time`) and reads what the first saved."""
    from contextlib import contextmanager

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    timed, theirs = [], costs(40, 0.5, 1)
    path = tmp_path / f"draft-cap-{draft_cap.cache_key(chat.target, chat.drafter)}.json"

    @contextmanager
    def the_other_start_timed_meanwhile(root, what, doing, progress):
        assert (root, what) == (tmp_path, "draft-cap") and not path.exists()
        path.write_text(json.dumps({"draft": theirs.draft, "verify": theirs.verify}))
        yield

    monkeypatch.setattr(draft_cap, "measure", lambda t, d: timed.append(1) or costs(40, 0.5, 1))
    monkeypatch.setattr(draft_cap, "one_start_at_a_time", the_other_start_timed_meanwhile)
    cap, kept = load_or_measure(chat.target, chat.drafter)
    assert timed == [] and cap == best_cap(theirs) and kept.verify == theirs.verify


# ---- found by a mutation review (benchmarks/RESULTS.md, fifty-sixth pass) ----


def test_a_short_context_holds_fewer_positions_while_timing():
    """A context of 20 positions: passes of up to 13 rows are timed after 7 held positions (20 - 13), so the
    widest pass ends at the context's end; a pass as wide as the context leaves none to hold: refused in words."""
    from conftest import tiny_decoder

    target, drafter = tiny_decoder("gpt2", seed=0, context=20), tiny_decoder("gpt2", seed=1, context=20)
    measured = draft_cap.measure(target, drafter, caps=(2, 12), turns=1)
    assert set(measured.verify) == {3, 13} and measured.draft > 0
    with pytest.raises(ValueError, match="a context of 20 positions is too short to time passes of 20 rows"):
        draft_cap.measure(target, drafter, caps=(19,), turns=1)


def test_the_cache_entry_names_the_drafter_too():
    """Another drafter (here: one more layer) is another entry: its steps cost otherwise."""
    from conftest import decoder_config, tiny_decoder

    target, drafter = tiny_decoder("llama", seed=0), tiny_decoder("llama", seed=1)
    cls, config = decoder_config("llama")
    config.num_hidden_layers = 3
    deeper = cls(config).double().eval()
    assert draft_cap.cache_key(target, deeper) != draft_cap.cache_key(target, drafter)
    assert draft_cap.cache_key(target, copy.deepcopy(drafter)) == draft_cap.cache_key(target, drafter)


def test_reading_a_saved_timing_marks_it_used(chat, tmp_path, monkeypatch):
    """`cache_prune` removes the entries used longest ago: a timing read at every start must count as used."""
    import os

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(draft_cap, "measure", lambda t, d: costs(40, 0.5, 1))
    load_or_measure(chat.target, chat.drafter)
    saved = next(tmp_path.glob("draft-cap-*.json"))
    os.utime(saved, (0, 0))
    load_or_measure(chat.target, chat.drafter)
    assert saved.stat().st_mtime > time.time() - 3600


def test_the_first_turn_warms_up_untimed(monkeypatch):
    """Each pass here takes 100 s of a virtual clock in the untimed first turn, then 1 s (the drafter's step) or
    3 s (a 3-row pass): the medians are the timed turns' alone."""
    from conftest import tiny_decoder

    now, calls = [0.0], []

    class Runner:
        def __init__(self, model, use_cache):
            self.device = model.device

        def logits(self, seq, width):
            calls.append(width)
            warm_up = 2 < len(calls) <= 4  # after the two held prefixes, the first turn's two passes
            now[0] += 100.0 if warm_up else float(width if width > 1 else 1)

    monkeypatch.setattr(draft_cap, "ModelRunner", Runner)
    monkeypatch.setattr(draft_cap, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    measured = draft_cap.measure(tiny_decoder("llama", seed=0), tiny_decoder("llama", seed=1), caps=(2,), turns=1)
    assert len(calls) == 6
    assert measured.draft == pytest.approx(1.0) and measured.verify == {3: pytest.approx(3.0)}
