"""The draft-stop rules (sampling/draft_stop.py): each changes only how many drafts a round proposes, so greedy
speculative decoding still equals AR and sampled decoding keeps the target's distribution; the learned rule's
head loads only for the drafter it was trained for, and its cost rule drafts what pays."""

import copy
import math
import shutil
import warnings

import pytest
import torch

from conftest import PROMPT, VOCAB, tiny_decoder
from sampling import DraftStopConfig, LoopSettings, autoregressive_generate, make_draft_stop, speculative_run
from sampling.acceptance_head import AcceptanceHead, drafter_identity, load_head, save_head
from sampling.draft_stop import Draft, LearnedStop, PassCosts, entropy, entropy_bound
from utils.chat.settings import Settings, draft_stop_from_flags, parse_draft_stop

GEN = 30
NO_EOS = -1


@pytest.fixture(scope="module")
def pair():
    return tiny_decoder("llama", seed=0), tiny_decoder("llama", seed=1)


@pytest.fixture(scope="module")
def head_file(pair, tmp_path_factory):
    """A random head for the tiny drafter: its predictions vary from draft to draft, which is all the rule's
    losslessness needs."""
    drafter = pair[1]
    torch.manual_seed(5)
    head = AcceptanceHead(drafter.config.hidden_size, width=8)
    path = tmp_path_factory.mktemp("head") / "head.pt"
    save_head(head, path, drafter_identity(drafter), {"seed": 5})
    return path


def rules(head_file) -> list[DraftStopConfig]:
    return [DraftStopConfig("fixed"), DraftStopConfig("adaptive"), DraftStopConfig("confidence", confidence=0.5),
            DraftStopConfig("entropy", entropy_bound=0.2), DraftStopConfig("confidence", confidence=0.5, adaptive=True),
            DraftStopConfig("learned", head=str(head_file)), DraftStopConfig("auto")]


@pytest.mark.parametrize("use_cache", [False, True])
def test_every_rule_is_lossless_greedy(pair, head_file, use_cache):
    target, drafter = pair
    reference = autoregressive_generate(PROMPT, target, max_gen_len=GEN, eos_tokens_id=NO_EOS)
    lengths = {}
    for config in rules(head_file):
        rounds = []
        result = speculative_run(PROMPT, drafter, target, settings=LoopSettings(GEN, 6, NO_EOS), use_cache=use_cache,
                                 on_round=rounds.append, draft_stop=config)
        assert result.tokens == reference, config.describe()
        # Drafts per round against what the budget allowed (the loop never drafts past max_gen_len).
        produced = [sum(len(r.tokens) for r in rounds[:i]) for i in range(len(rounds))]
        lengths[config.describe()] = [(len(r.drafts), min(6, GEN - done - 1)) for r, done in zip(rounds, produced)][1:]
    assert all(n == allowed for n, allowed in lengths["fixed"])
    # The thresholds fire on these random models: rounds shorter than the budget allowed.
    for rule in ("entropy 0.2", "confidence 0.5"):
        assert any(n < allowed for n, allowed in lengths[rule]), rule
    # auto: confidence 0.9 with the cache on, 0.6 with it off; both stop on these random models
    assert any(n < allowed for n, allowed in lengths["auto"])


def test_auto_is_confidence_with_a_threshold_for_the_cache_on_and_one_for_it_off():
    from sampling.draft_stop import RuleStop, resolve

    assert resolve(DraftStopConfig("auto"), True) == DraftStopConfig("confidence", confidence=0.9)
    assert resolve(DraftStopConfig("auto", confidence=0.7), True) == DraftStopConfig("confidence", confidence=0.7)
    assert resolve(DraftStopConfig("auto"), False) == DraftStopConfig("confidence", confidence=0.6)
    assert resolve(DraftStopConfig("auto", confidence=0.7), False) == DraftStopConfig("confidence", confidence=0.6)
    # sampled drafts are accepted less often than greedy ones: cache off, the round stops sooner
    assert resolve(DraftStopConfig("auto"), False, greedy=False) == DraftStopConfig("confidence", confidence=0.75)
    assert resolve(DraftStopConfig("auto"), True, greedy=False) == DraftStopConfig("confidence", confidence=0.9)
    assert resolve(DraftStopConfig("entropy"), False) == DraftStopConfig("entropy")  # others as they are
    on, off = make_draft_stop(DraftStopConfig("auto")), make_draft_stop(DraftStopConfig("auto"), use_cache=False)
    assert isinstance(on, RuleStop) and on.confidence == 0.9 and off.confidence == 0.6 and off.bound is None
    assert on.schedule is None and off.schedule is None  # at most gamma drafts, every round
    assert make_draft_stop(DraftStopConfig("auto"), use_cache=False, greedy=False).confidence == 0.75


def test_a_kept_learned_rule_carries_its_measurements_across_calls(pair, head_file):
    target, drafter = pair
    rule = make_draft_stop(DraftStopConfig("learned", head=str(head_file)), drafter)
    reference = autoregressive_generate(PROMPT, target, max_gen_len=GEN, eos_tokens_id=NO_EOS)
    for call in range(2):
        result = speculative_run(PROMPT, drafter, target, settings=LoopSettings(GEN, 4, NO_EOS), draft_stop=rule)
        assert result.tokens == reference
        if call == 0:  # every round times its verification pass; a drafter step needs a round of 2 drafts, which
            first = dict(rule.costs.verify_by_width)  # this random head's timing-dependent stops may not give
            assert first
    assert rule.costs.verify_by_width != first and set(first) <= set(rule.costs.verify_by_width)  # kept, updated


class ConstantHead:
    def __init__(self, a: float):
        self.a = a

    def predict(self, hidden, probs) -> float:
        return self.a


def costs(draft: float, verify: dict[int, float]) -> PassCosts:
    c = PassCosts()
    c.draft, c.verify_by_width = draft, dict(verify)
    return c


def drafts_in_a_round(rule: LearnedStop, gamma: int) -> int:
    length = rule.length(gamma)
    for index in range(1, length):
        if not rule.keep_going(Draft(index, torch.zeros(1, 4), torch.ones(1, 4) / 4, True, torch.zeros(1, 2))):
            return index
    return length


def test_learned_rule_drafts_while_a_draft_pays():
    # Wide passes nearly free (a GPU): a likely draft always pays, so the round drafts gamma.
    cheap = LearnedStop(ConstantHead(0.9), costs(0.1, {1: 1.0, 2: 1.01, 3: 1.02, 4: 1.03, 5: 1.04}))
    assert drafts_in_a_round(cheap, 4) == 4
    # An unlikely draft does not pay for its drafter step and wider pass: stop after the first.
    doubtful = LearnedStop(ConstantHead(0.05), costs(0.1, {1: 1.0, 2: 1.01, 3: 1.02}))
    assert drafts_in_a_round(doubtful, 4) == 1


def test_learned_rule_falls_back_to_plain_decoding_where_drafts_cannot_pay_and_probes():
    # The 2-core Zen 1 of RESULTS.md: a drafter step 40 ms, one row 84 ms, two rows 127 ms. Even a draft that is
    # always accepted yields 2 tokens in 167 ms, against 2 in 168 ms without drafting.
    rule = LearnedStop(ConstantHead(0.99), costs(0.040, {1: 0.084, 2: 0.127, 3: 0.177}))
    rule.first_acceptance = 0.9
    every = LearnedStop.PROBE_EVERY
    lengths = [rule.length(3) for _ in range(3 * every)]
    assert [i for i, n in enumerate(lengths) if n] == [every - 1, 3 * every - 1]  # probes, ever rarer
    assert set(lengths) == {0, 3}


def test_learned_rule_times_drafts_after_the_first_step_of_a_round(monkeypatch):
    # An answer's first step also reads the prompt (here 2 s); the steps after it take 0.05 s each. Timed in, the
    # prefill made every draft look costly and the rule stopped drafting where drafts pay (the Xeon of RESULTS.md).
    clock = iter([2.0, 2.15])  # the round's first draft made (its step read the prompt), three more made
    monkeypatch.setattr("sampling.draft_stop.time.perf_counter", lambda: next(clock))
    rule = LearnedStop(ConstantHead(0.9))
    assert drafts_in_a_round(rule, 4) == 4
    rule.drafted(4)
    assert rule.costs.draft == pytest.approx(0.05)
    one = LearnedStop(ConstantHead(0.9))  # a one-draft round measures no step: the cost stays unknown
    one.steady = 0.0
    clock = iter([9.0])
    one.drafted(1)
    assert one.costs.draft is None


def test_pass_costs_interpolate_and_extrapolate_measured_widths():
    c = PassCosts()
    assert c.verify(3) == pytest.approx(1.5)  # nothing measured: each extra row a quarter of a one-row pass
    c.observe_verify(1, 0.08)
    assert c.verify(5) == pytest.approx(0.08 + 4 * 0.02)
    c.observe_verify(3, 0.16)
    assert c.verify(2) == pytest.approx(0.12) and c.verify(5) == pytest.approx(0.24)
    c.observe_verify(3, 0.26)  # averaged with what it measured before
    assert 0.16 < c.verify(3) < 0.26
    c.observe_draft(0.3, 3)
    assert c.draft == pytest.approx(0.1)
    one = PassCosts()  # one wide width measured, at what ROW_COST says: the one-row pass follows from it
    one.observe_verify(7, 2.5)
    assert one.verify(1) == pytest.approx(1.0) and one.verify(9) == pytest.approx(3.0)  # was 1.96 and 2.68


def test_pass_costs_forget_a_width_not_measured_for_a_while():
    """A width timed dear once (a slow moment) made rounds stop short of it, so it was never timed again."""
    c = PassCosts()
    c.observe_verify(5, 0.120)
    for _ in range(PassCosts.FORGET_AFTER):
        c.observe_verify(2, 0.050)
    assert c.verify(5) == pytest.approx(0.120)  # measured FORGET_AFTER drafting rounds ago: kept
    c.observe_verify(3, 0.055)
    assert 5 not in c.verify_by_width and c.verify(5) == pytest.approx(0.065)  # from the widths measured since
    for _ in range(10 * PassCosts.FORGET_AFTER):  # rounds without drafts (a rule that stopped drafting): no clock
        c.observe_verify(1, 0.045)
    assert c.verify(2) == pytest.approx(0.050) and c.verify(3) == pytest.approx(0.055)


def test_learned_rule_drafts_again_up_to_a_width_it_timed_dear_once():
    # The Zen 3 of RESULTS.md: 4 and 5 rows timed once at 86 and 120 ms, where passes of up to 3 rows cost ~50 ms
    # and a drafter step 16 ms; drafts accepted at 95%
    rule = LearnedStop(ConstantHead(0.95), costs(0.016, {1: 0.049, 2: 0.048, 3: 0.053, 4: 0.086, 5: 0.120}))
    assert drafts_in_a_round(rule, 4) == 2
    for _ in range(PassCosts.FORGET_AFTER + 1):  # rounds of 1 and 2 drafts, timed as before
        rule.costs.observe_verify(2, 0.048)
        rule.costs.observe_verify(3, 0.053)
    assert drafts_in_a_round(rule, 4) == 4  # 4 and 5 rows extrapolated: the rule drafts, and so times them again


@pytest.mark.parametrize("config, message", [
    # fixed quietly became adaptive (still described as fixed); auto and learned dropped it without a word
    (lambda: DraftStopConfig("fixed", adaptive=True), "for 'fixed' use the rule 'adaptive'"),
    (lambda: DraftStopConfig("auto", adaptive=True), "for 'auto' use the rule 'adaptive'"),
    (lambda: DraftStopConfig("learned", adaptive=True), "for 'learned' use the rule 'adaptive'"),
    (lambda: DraftStopConfig("confidence", adaptive="yes"), "adaptive must be True or False, got 'yes'"),
    (lambda: DraftStopConfig("learned", head=5), "head must be a file's path, got 5"),
    # every other rule ignored a head file without a word
    (lambda: DraftStopConfig("confidence", head="head.pt"), "read only by the rule 'learned', not 'confidence'"),
    (lambda: DraftStopConfig("auto", head="head.pt"), "read only by the rule 'learned', not 'auto'"),
])
def test_a_config_that_would_be_read_otherwise_than_it_says_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        config()
    assert DraftStopConfig("entropy", adaptive=True).describe() == "entropy 0.5 + adaptive"


def test_entropy_bound_is_one_for_a_certain_draft_and_falls_with_entropy():
    assert entropy_bound(torch.tensor([[1.0, 0.0, 0.0]])) == pytest.approx(1.0)
    uniform = torch.full((1, 4), 0.25)
    assert entropy_bound(uniform) == pytest.approx(1 - (4 * 0.25 * 1.3862944) ** 0.5, abs=1e-5)
    # a shortlist head's -inf logits give zero probabilities, which add nothing; rows are independent
    probs = torch.tensor([[0.0, 0.0, float("-inf")], [1.0, float("-inf"), float("-inf")]]).softmax(-1)
    assert torch.allclose(entropy(probs), torch.tensor([[math.log(2)], [0.0]]))


def test_rules_read_the_same_on_a_shortlist_heads_support(head_file):
    """A shortlist head's logits are -inf off its ids: read on those ids alone, the top probabilities, the entropy
    and so the head's prediction are the full distribution's (up to the order of a float sum)."""
    torch.manual_seed(3)
    support = torch.tensor([0, 5, 6, 9, 20, 31])
    logits = torch.full((1, 32), float("-inf"))
    logits[0, support] = torch.randn(6) * 2
    q = torch.softmax(logits / 0.7, -1)
    head = load_head(head_file, None)
    hidden = torch.randn(1, head.mean.numel() - 4)
    for greedy in (True, False):
        full, short = Draft(1, logits, q, greedy, hidden), Draft(1, logits, q, greedy, hidden, support)
        assert short.probs.shape == (1, 6) and short.sampled.shape == (1, 6)
        assert short.sampled.max() == pytest.approx(float(full.sampled.max()), rel=1e-6)
        assert entropy_bound(short.sampled) == pytest.approx(entropy_bound(full.sampled), rel=1e-5)
        assert head.predict(hidden, short.probs) == pytest.approx(head.predict(hidden, full.probs), rel=1e-5)


@pytest.mark.parametrize("use_cache", [False, True])
def test_rules_read_a_shortlist_drafters_support_and_stay_lossless(pair, head_file, use_cache):
    """The drafter hands its shortlist's ids to the rules (with the conversation's tokens it added), and every rule
    still gives AR's tokens."""
    from utils.models.draft_vocab import ShortlistHead

    target, drafter = pair[0], copy.deepcopy(pair[1])
    vocab = drafter.config.vocab_size
    head = ShortlistHead(drafter.get_output_embeddings(), torch.arange(0, vocab, 3), vocab)
    drafter.set_output_embeddings(head)
    seen = []
    original = Draft.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(self.support)

    reference = autoregressive_generate(PROMPT, target, max_gen_len=GEN, eos_tokens_id=NO_EOS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Draft, "__init__", record)
        for config in rules(head_file):
            result = speculative_run(PROMPT, drafter, target, settings=LoopSettings(GEN, 6, NO_EOS),
                                     use_cache=use_cache, draft_stop=config)
            assert result.tokens == reference, config.describe()
    # the support is on the drafter's device (the ids above were made on the CPU), so the rules can index its logits
    assert seen and all(s is not None and s.device == head.weight.device for s in seen)
    assert all(torch.isin(head.ids, s).all() and head.listed[s.cpu()].all() for s in seen)
    assert max(len(s) for s in seen) > head.ids.numel()  # the conversation's unlisted tokens joined the support


def test_head_loads_only_for_its_drafter(pair, head_file, tmp_path, monkeypatch):
    target, drafter = pair
    assert isinstance(load_head(head_file, drafter), AcceptanceHead)
    with pytest.raises(ValueError, match="trained for another drafter"):
        load_head(head_file, tiny_decoder("llama", seed=1, vocab=VOCAB + 4))
    with pytest.raises(ValueError, match="no acceptance head at"):
        load_head(tmp_path / "missing.pt", drafter)
    (tmp_path / "bad.pt").write_bytes(b"not a head")
    with pytest.raises(ValueError, match="is not an acceptance head"):
        load_head(tmp_path / "bad.pt", drafter)
    with pytest.raises(ValueError, match=r"^cannot read .{100,180}: File name too long$"):
        load_head(tmp_path / ("x" * 300), drafter)  # the path cut: the one-line error keeps 300 characters
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")  # indexing it warned before the one line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="tensor.pt is not an acceptance head"):
            load_head(tmp_path / "tensor.pt", drafter)
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copy(head_file, tmp_path / "mine.pt")
    assert isinstance(load_head("~/mine.pt", drafter), AcceptanceHead)  # as --prompt-file and --ngram-cache read ~
    with pytest.raises(ValueError, match="~nosuchuser-specdec names no user of this system"):
        load_head("~nosuchuser-specdec/h.pt", drafter)  # expanduser's RuntimeError was a traceback


def test_draft_stop_text_and_the_older_flags():
    assert parse_draft_stop("entropy 0.3") == DraftStopConfig("entropy", entropy_bound=0.3)
    assert parse_draft_stop("learned /a b/head.pt").head == "/a b/head.pt"
    assert parse_draft_stop("CONFIDENCE").rule == "confidence"
    for bad, message in [("", "must be one of"), ("fast", "must be one of"), ("fixed 3", "fixed takes no value"),
                         ("auto 0.5", "auto takes no value"), ("adaptive 2", "adaptive takes no value"),
                         ("entropy x", "not a number"), ("confidence 1", "confidence must be in"),
                         ("entropy 0.5 0.6", "entropy takes one value, got '0.5 0.6'")]:
        with pytest.raises(ValueError, match=message):
            parse_draft_stop(bad)
    assert draft_stop_from_flags("fixed", True, 0.0) == DraftStopConfig("adaptive")
    assert draft_stop_from_flags("fixed", True, 0.5) == DraftStopConfig("confidence", confidence=0.5, adaptive=True)
    with pytest.raises(ValueError, match="^--confidence is an older spelling of --draft-stop"):
        draft_stop_from_flags("entropy", False, 0.5)  # --adaptive was not given: not named
    with pytest.raises(ValueError, match="^--adaptive and --confidence are older spellings of --draft-stop"):
        draft_stop_from_flags("entropy", True, 0.5)
    # not given: the chat's default, which the older flags replace as they replaced `fixed` before
    assert draft_stop_from_flags(None, False, 0.0) == DraftStopConfig("auto") == Settings().draft_stop
    assert draft_stop_from_flags(None, True, 0.0) == DraftStopConfig("adaptive")
    assert draft_stop_from_flags(None, False, 0.5) == DraftStopConfig("confidence", confidence=0.5)
    assert DraftStopConfig() == DraftStopConfig("fixed")  # the library's loops keep a fixed gamma


def test_the_speculative_report_names_its_rule_and_mean_draft_length():
    from utils.chat.report import Report, stats_line

    report = Report("speculative", "x", [1] * 12, 12, 1.0, 12.0, 0.5, 1.1, 5, 9, drafted=10, accepted=5, rounds=4,
                    draft_stop="entropy 0.5")
    assert "2.5 drafts/round (entropy 0.5)" in stats_line(report)
    assert "drafts/round" not in stats_line(Report("target", "x", [1], 1, 1.0, 1.0, None, 1.0, 1, 0, rounds=1))
    assert "12 tokens" in stats_line(report) and "5 target forwards" in stats_line(report)
    one = stats_line(Report("target", "x", [1], 1, 1.0, 1.0, None, 1.0, 1, 0, rounds=1))
    assert one.startswith("1 token · ") and "1 target forward ·" in one  # not "1 tokens"


def test_the_report_line_names_the_cap_the_wait_and_a_speculative_answer_that_drafted_nothing():
    from utils.chat.report import Report, stats_line

    line = stats_line(Report("speculative", "x", [1] * 8, 8, 2.0, 4.0, 0.625, 1.234, 3, 9, first_token_s=0.5,
                             drafted=8, accepted=5, rounds=2, draft_stop="confidence 0.6", gamma=6))
    assert line == ("8 tokens · 2.00 s · first token 0.50 s · 4.00 tokens/s · 4.0 drafts/round (confidence 0.6, "
                    "at most 6) · acceptance 62% · 3 target forwards · speedup 1.23x")
    # a round that drafted nothing is no acceptance of 0%, and no rounds divide nothing (ZeroDivisionError)
    idle = stats_line(Report("speculative", "x", [1], 1, 1.0, 1.0, None, None, 1, 1, draft_stop="fixed"))
    assert "acceptance n/a (nothing drafted)" in idle and "drafts/round" not in idle
    assert "0 tokens · " in stats_line(Report("target", "", [], 0, 1.0, 0.0, None, None, 1, 0))  # plural at 0


# ---- found by a mutation review (benchmarks/RESULTS.md, fifty-sixth pass) ----


def test_sampled_rules_read_the_drafts_distribution_and_the_head_its_softmax():
    """Sampling at temperature 0.5: the confidence rule reads q, the distribution the draft was drawn from (its
    top probability 0.79 here, the raw softmax's 0.55), while the learned head reads the softmax at temperature 1,
    as it was trained (benchmarks/train_acceptance_head.py)."""
    from sampling.draft_stop import RuleStop

    logits = torch.tensor([[2.0, 1.2, 0.5, 0.0]])
    q = torch.softmax(logits / 0.5, -1)
    draft = Draft(1, logits, q, False, torch.zeros(1, 2))
    assert torch.equal(draft.sampled, q)
    assert RuleStop(confidence=0.7).keep_going(draft)  # 0.79 >= 0.7; read at temperature 1 (0.55) it stopped
    assert entropy_bound(draft.sampled) == pytest.approx(1 - float(torch.special.entr(q).sum()) ** 0.5)

    seen = []

    class RecordingHead:
        def predict(self, hidden, probs):
            seen.append(probs)
            return 0.9

    LearnedStop(RecordingHead()).keep_going(draft)
    assert torch.allclose(seen[0], torch.softmax(logits, -1))


def test_learned_rule_weighs_a_draft_against_the_rounds_expected_tokens():
    """The cost rule by hand: a = 0.8, a drafter step 0.1, passes of 1-4 rows 1.0 / 1.1 / 1.4 / 1.8.
    Draft 1: E(1) = 1.8 in 0.1 + 1.1 s; a second adds 0.8 * 0.8 = 0.64 tokens for 0.1 + 0.3 s: 1.6/s > 1.5/s, go on.
    Draft 2: E(2) = 2.44 in 0.2 + 1.4 s; a third adds 0.512 for 0.1 + 0.4 s: 1.02/s < 1.53/s, stop: 2 drafts."""
    rule = LearnedStop(ConstantHead(0.8), costs(0.1, {1: 1.0, 2: 1.1, 3: 1.4, 4: 1.8}))
    assert drafts_in_a_round(rule, 3) == 2
    assert rule.reach == pytest.approx(0.64) and rule.expected == pytest.approx(1 + 0.8 + 0.64)


def test_learned_rule_times_each_verification_at_its_width_and_learns_from_drafted_rounds(monkeypatch):
    """A round of 4 drafts is verified by a 5-row pass; a round without drafts by a 1-row pass, and it says nothing
    about how often first drafts are accepted."""
    clock = iter([1.0, 1.3, 1.8])  # the first draft made, the round's drafting ended, its verdict
    monkeypatch.setattr("sampling.draft_stop.time.perf_counter", lambda: next(clock))
    rule = LearnedStop(ConstantHead(0.9))
    assert drafts_in_a_round(rule, 4) == 4
    rule.drafted(4)
    rule.update(2, 4)
    assert rule.costs.draft == pytest.approx(0.1)  # 3 steps after the first in 0.3 s
    assert rule.costs.verify_by_width == {5: pytest.approx(0.5)}  # 4 drafts and the target's row
    assert rule.first_acceptance == pytest.approx(1.0)  # its first draft was accepted

    idle = LearnedStop(ConstantHead(0.99), costs(0.040, {1: 0.084, 2: 0.127, 3: 0.177}))  # drafts cannot pay
    idle.first_acceptance = 0.9
    clock = iter([5.0, 5.0, 5.1])  # the round's start, its (empty) drafting's end, its verdict
    assert idle.length(3) == 0
    idle.drafted(0)
    idle.update(0, 0)
    assert set(idle.costs.verify_by_width) == {1, 2, 3}
    assert idle.costs.verify_by_width[1] == pytest.approx(0.8 * 0.084 + 0.2 * 0.1)
    assert idle.first_acceptance == 0.9  # no draft, no verdict on one


def test_a_round_that_drafts_restarts_the_probe_interval():
    """Probes double their interval while drafting cannot pay; once a round drafts because it pays, the next idle
    stretch probes after PROBE_EVERY rounds again, not after the doubled interval."""
    rule = LearnedStop(ConstantHead(0.99), costs(0.040, {1: 0.084, 2: 0.127, 3: 0.177}))
    every = LearnedStop.PROBE_EVERY
    rule.first_acceptance = 0.9  # a first draft at 0.9 does not pay here; at 1.0 it does (0.084 >= 0.083)
    assert [i for i in range(every) if rule.length(3)] == [every - 1]
    rule.first_acceptance = 1.0
    assert rule.length(3) == 3
    rule.first_acceptance = 0.9
    assert [i for i in range(every) if rule.length(3)] == [every - 1]


def test_head_checks_the_drafters_depth_and_reads_its_norm_in_any_dtype(pair, head_file):
    from conftest import decoder_config

    drafter = pair[1]
    cls, config = decoder_config("llama")
    config.num_hidden_layers = 3  # same widths, same (all-ones) final norm: only the depth tells them apart
    torch.manual_seed(1)
    deeper = cls(config).double().eval()
    with pytest.raises(ValueError, match="trained for another drafter \\(num_hidden_layers 2 here 3\\)"):
        load_head(head_file, deeper)
    # the head was saved for the float64 drafter; the same weights in float32 or bfloat16 are the same drafter
    for dtype in (torch.float32, torch.bfloat16):
        assert isinstance(load_head(head_file, copy.deepcopy(drafter).to(dtype)), AcceptanceHead)


def test_a_head_without_the_hidden_state_ignores_it():
    torch.manual_seed(0)
    head = AcceptanceHead(6, width=4, use_hidden=False)
    probs = torch.softmax(torch.randn(1, 10), -1)
    assert head.mask.tolist() == [0.0] * 6 + [1.0] * 4
    assert head.predict(torch.randn(1, 6) * 5, probs) == pytest.approx(head.predict(torch.zeros(1, 6), probs))


def test_the_shipped_head_reads_its_features_as_trained():
    """The shipped head (trained without the hidden state, its features standardised): a sure draft is predicted
    accepted, a doubtful one much less, and the hidden state changes nothing. Its features in another order, the
    standardisation inverted or the mask ignored each break one of these."""
    head = load_head(None, None)
    assert head.provenance["hidden_state"] is False
    hidden = head.mean.numel() - 4

    def top(p, n=1000):
        probs = torch.full((1, n), (1 - p) / (n - 1))
        probs[0, 0] = p
        return probs

    sure, likely, doubtful = (head.predict(torch.zeros(1, hidden), top(p)) for p in (0.99, 0.9, 0.6))
    assert sure > 0.95 and sure > likely > doubtful and doubtful < 0.75
    torch.manual_seed(0)
    assert head.predict(torch.randn(1, hidden) * 3, top(0.9)) == pytest.approx(likely, abs=1e-6)


def test_confidence_on_an_adaptive_length_follows_acceptance():
    """`confidence 0.5 + adaptive` (--adaptive with a confidence rule): the length schedule is built too, so a
    rejection shortens the next round (-1) and a fully accepted one lengthens it (+2, up to gamma)."""
    rule = make_draft_stop(DraftStopConfig("confidence", confidence=0.5, adaptive=True))
    assert rule.length(6) == 6
    rule.update(1, 3)
    assert rule.length(6) == 5
    rule.update(2, 2)
    assert rule.length(6) == 6 and make_draft_stop(DraftStopConfig("confidence", confidence=0.5)).schedule is None


def test_entropy_zero_stops_where_the_bound_falls_below_zero():
    """1 - sqrt(H) < 0 once H > 1 nat: a uniform draft over 8 tokens (H = 2.08) ends the round under `entropy 0`,
    as it does under `entropy 0.01`."""
    probs = torch.full((1, 8), 1 / 8)
    draft = Draft(1, probs.log(), probs, True, None)
    assert not make_draft_stop(DraftStopConfig("entropy", entropy_bound=0.01)).keep_going(draft)
    assert not make_draft_stop(DraftStopConfig("entropy", entropy_bound=0.0)).keep_going(draft)


def test_the_head_predicts_a_chance_not_a_logit():
    # LearnedStop multiplies the predictions into the chance that every draft of the round is accepted, and
    # weighs a draft by it: a raw logit (here about 3) would count one draft as three accepted tokens
    torch.manual_seed(0)
    head = AcceptanceHead(6, width=4)
    with torch.no_grad():
        head.mlp[2].bias.fill_(3.0)
    probs = torch.softmax(torch.randn(1, 10), -1)
    hidden = torch.randn(1, 6)
    assert 0.9 < head.predict(hidden, probs) < 1


def test_head_tells_drafters_of_one_shape_apart_by_their_final_norm(pair, tmp_path):
    """Two drafters of the same shapes (a fine-tune, another checkpoint) differ in their weights: the final norm's
    fingerprint refuses a head trained for the other one, while the same weights stored a little differently
    (dequantized, converted; here off by 1e-5) are the same drafter."""
    drafter = copy.deepcopy(pair[1])
    hidden = drafter.config.hidden_size
    with torch.no_grad():
        drafter.model.norm.weight.copy_(1 + torch.arange(hidden, dtype=torch.float64) / 100)
    save_head(AcceptanceHead(hidden, width=4), tmp_path / "head.pt", drafter_identity(drafter), {})
    with torch.no_grad():
        drafter.model.norm.weight.add_(1e-5)
    assert isinstance(load_head(tmp_path / "head.pt", drafter), AcceptanceHead)
    with torch.no_grad():
        drafter.model.norm.weight[3] += 0.05
    with pytest.raises(ValueError, match="trained for another drafter \\(norm_fingerprint"):
        load_head(tmp_path / "head.pt", drafter)


def test_a_drafter_without_a_final_norm_to_read_is_checked_by_its_shapes(pair, head_file):
    # A drafter whose final norm is not at `model.norm` (another layout) has no fingerprint: a head must still
    # load for it when the shapes agree, and be refused when they differ
    drafter = copy.deepcopy(pair[1])
    drafter.model.norm = None
    assert drafter_identity(drafter)["norm_fingerprint"] is None
    assert isinstance(load_head(head_file, drafter), AcceptanceHead)
    other = tiny_decoder("llama", seed=1, vocab=VOCAB + 4)
    other.model.norm = None
    with pytest.raises(ValueError, match="trained for another drafter \\(vocab_size"):
        load_head(head_file, other)
