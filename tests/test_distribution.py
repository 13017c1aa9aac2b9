"""Sampled speculative decoding and NASD draw from exactly the target's distribution.

Over a 12-token vocabulary the exact distribution of the first two generated tokens is enumerated from the
target and compared with thousands of samples by a chi-square test. The drafter is a different random model
with peaked, different distributions, so a wrong acceptance rule shows up: `test_test_has_power` runs the same
test without the residual step and requires the chi-square test to reject it.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from conftest import TEST_DEVICE, ids, near_drafter, tiny_decoder
from ngram_assisted import NGramStorage, OneLevelNGramStorage, nasd_run
from sampling import LoopSettings, speculative_run
from sampling.draft_stop import PassCosts
from utils.model_runner import ModelRunner
from utils.models.cpu_kernels import quantize_int8
from utils.logits_processor import MultinomialProcessor, NucleusProcessor, TopKNucleusProcessor, TopKProcessor

VOCAB = 12
SAMPLES = 3000
PROMPT = [3, 4, 5, 3, 4]
LENGTH = 2

PROCESSORS = {
    "multinomial": MultinomialProcessor(1.0),
    "temperature": MultinomialProcessor(0.6),
    "topk": TopKProcessor(1.0, top_k=4),
    "nucleus": NucleusProcessor(1.0, top_p=0.8),
    "topknucleus": TopKNucleusProcessor(0.8, top_k=5, top_p=0.9),
}


@pytest.fixture(scope="module")
def models():
    # A peaked target and a near-uniform drafter: many rejections, so a wrong rule after one shows up.
    target = tiny_decoder("llama", seed=3, vocab=VOCAB, init=0.6)
    drafter = tiny_decoder("llama", seed=4, vocab=VOCAB, init=0.02)
    return target, drafter


@pytest.fixture(scope="module")
def near(models):
    """A drafter close to the target (its weights perturbed by half their spread): its q overlaps p under every
    processor, so the residual step decides many samples. Against the near-uniform drafter a missing residual
    step went unseen under nucleus sampling (p = 0.09)."""
    return near_drafter(models[0], 0.5, seed=4)


@torch.no_grad()
def exact_distribution(target, processor, length: int = LENGTH, vocab: int = VOCAB) -> dict[tuple[int, ...], float]:
    """The probability of every continuation of `length` tokens, by enumeration."""
    exact = {(): 1.0}
    for _ in range(length):
        prefixes = list(exact)
        rows = torch.tensor([PROMPT + list(x) for x in prefixes], device=target.device)  # native models: CPU
        nexts = processor(target(rows).logits[:, -1])  # [prefixes, vocab]
        exact = {x + (b,): exact[x] * float(nexts[i, b]) for i, x in enumerate(prefixes) for b in range(vocab)}
    return exact


def chi_square_pvalue(samples: list[tuple[int, int]], exact: dict) -> float:
    counts = {key: 0 for key in exact}
    for s in samples:
        counts[s] += 1
    # Outcomes expected fewer than 5 times are pooled, as the test requires.
    keys = [k for k in exact if exact[k] * len(samples) >= 5]
    observed = [counts[k] for k in keys]
    expected = [exact[k] * len(samples) for k in keys]
    rest_obs = len(samples) - sum(observed)
    rest_exp = max(len(samples) - sum(expected), 0.0)  # rounding can leave -1e-12 where nothing is expected
    if rest_exp >= 5:
        observed.append(rest_obs)
        expected.append(rest_exp)
    else:
        assert rest_obs <= 5 + 4 * rest_exp ** 0.5 + 5, "samples fell where the target puts (almost) no mass"
        scale = sum(observed) / sum(expected)
        expected = [e * scale for e in expected]
    return chisquare(observed, expected).pvalue


class RememberingRunner(ModelRunner):
    """A cache-off runner that remembers each pass. A model is a fixed function of the ids it reads, so the
    sampling code under test sees exactly the logits a fresh pass would give, and thousands of samples cost the
    few hundred distinct passes they contain (a prompt of 5 and at most 3 more tokens of 12) instead of one pass
    per draft and verification: the chi-square tests' time was almost all tiny forward passes."""

    def __init__(self, model: torch.nn.Module, window: int = 0):
        super().__init__(model, use_cache=False, window=window)
        self.passes: dict[tuple, torch.Tensor] = {}

    def forward(self, new_ids, k, positions):
        key = (tuple(new_ids[0].tolist()), tuple(positions.tolist()), k)
        head = self.model.get_output_embeddings()
        if key not in self.passes:
            seen = []
            hook = head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
            try:
                super().forward(new_ids, k, positions)
            finally:
                hook.remove()
            self.passes[key] = seen[-1]  # the output layer's input: [1, k, hidden]
        # The output layer alone, run again on what it read: the same logits, and a learned draft stop's hook
        # sees the hidden state a real pass gives.
        return SimpleNamespace(logits=head(self.passes[key]))


def sample_speculative(target, drafter, processor, skip_adjustment=False):
    settings = LoopSettings(max_gen_len=LENGTH, gamma=2, eos_tokens_id=-1, first_target=False,
                            skip_sample_adjustment=skip_adjustment)
    runners = RememberingRunner(target), RememberingRunner(drafter)
    return [tuple(speculative_run(PROMPT, drafter, target, processor, settings, runners=runners).tokens)
            for _ in range(SAMPLES)]


def sample_nasd(target, processor, prior=None, storage=lambda: NGramStorage(3, VOCAB)):
    settings = LoopSettings(max_gen_len=LENGTH, gamma=2, eos_tokens_id=-1, first_target=False)
    runner = RememberingRunner(target)
    out = []
    for _ in range(SAMPLES):
        result = nasd_run(PROMPT, storage(), target, processor, settings, runner=runner, prior=prior)
        out.append(tuple(result.tokens))
    return out


@pytest.mark.parametrize("drafter_kind", ["near-uniform", "near"])
@pytest.mark.parametrize("name", list(PROCESSORS))
def test_speculative_sampling_matches_target(models, near, name, drafter_kind):
    target, drafter = models[0], models[1] if drafter_kind == "near-uniform" else near
    torch.manual_seed(0)
    processor = PROCESSORS[name]
    assert chi_square_pvalue(sample_speculative(target, drafter, processor), exact_distribution(target, processor)) > 1e-3


def likely_storage(target):
    """A storage that drafts the target's most likely token after the prompt (two counts against the prompt's one
    "3 4 -> 5"): the prompt's own n-gram drafted 5, a token the target gives ~0.2% and nearly always rejected, so a
    wrong rule after a rejection went unseen."""
    with torch.no_grad():
        likely = int(target(ids([PROMPT])).logits[0, -1].argmax())

    def storage():
        made = NGramStorage(3, VOCAB)
        made.add([3, 4], [likely, likely])
        return made

    return storage


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_nasd_sampling_matches_target(models, name):
    target, _ = models
    torch.manual_seed(1)
    processor = PROCESSORS[name]
    samples = sample_nasd(target, processor, storage=likely_storage(target))
    loop = LoopSettings(max_gen_len=LENGTH, gamma=2, eos_tokens_id=-1, first_target=False)
    kept = sum(nasd_run(PROMPT, likely_storage(target)(), target, processor, loop).accepted for _ in range(200))
    assert 20 <= kept <= 180  # drafts kept and rejected: both branches decide samples
    assert chi_square_pvalue(samples, exact_distribution(target, processor)) > 1e-3


@pytest.mark.parametrize("name", ["multinomial", "nucleus"])
def test_nasd_with_a_prior_keeps_the_distribution(models, name):
    """NASD's prior (ngram_prior.py) drafts wherever the conversation's storage knows no context. Here the
    storage keeps only 3-token contexts, none of which ends the prompt, and the prior has a follower for every
    token: every sample's first draft is the prior's (about a third of them kept, by hand)."""
    target, _ = models
    prior = NGramStorage(3, VOCAB)
    for token in range(VOCAB):
        prior.add([token], [(5 * token + 1) % VOCAB])
    torch.manual_seed(2)
    processor = PROCESSORS[name]
    samples = sample_nasd(target, processor, prior, storage=lambda: OneLevelNGramStorage(4, VOCAB))
    assert chi_square_pvalue(samples, exact_distribution(target, processor)) > 1e-3
    loop = LoopSettings(max_gen_len=LENGTH, gamma=2, eos_tokens_id=-1, first_target=False)
    drafted = [nasd_run(PROMPT, OneLevelNGramStorage(4, VOCAB), target, processor, loop, prior=p).drafted
               for p in (None, prior)]
    assert drafted[0] == 0 < drafted[1]  # the prior's drafts are what was tested


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="int8 drafters are a CPU feature (torch's dynamic int8 layers)")
def test_int8_drafter_keeps_the_distribution(models):
    """The CLI drafts with an int8 copy of the drafter (float32 on CPU): other q, same output distribution."""
    target, drafter = models
    int8_drafter = copy.deepcopy(drafter).float()
    assert quantize_int8(int8_drafter) > 0
    torch.manual_seed(3)
    processor = PROCESSORS["topk"]
    samples = sample_speculative(target, int8_drafter, processor)
    assert chi_square_pvalue(samples, exact_distribution(target, processor)) > 1e-3


def test_shortlist_drafter_keeps_the_distribution(models):
    """A drafter whose head lists a third of the vocabulary (`--draft-vocab`; the prompt's tokens join it): its q
    is zero elsewhere, and the target's tokens there come only from the residual step."""
    from utils.models.draft_vocab import ShortlistHead

    target, drafter = models
    shortlisted = copy.deepcopy(drafter)
    shortlisted.set_output_embeddings(ShortlistHead(drafter.get_output_embeddings(), ids([0, 6, 9, 11]),
                                                    VOCAB))
    torch.manual_seed(4)
    processor = PROCESSORS["multinomial"]
    samples = sample_speculative(target, shortlisted, processor)
    assert chi_square_pvalue(samples, exact_distribution(target, processor)) > 1e-3


def test_a_drafter_with_fewer_ids_keeps_the_distribution(models):
    """A drafter of 9 ids for the target's 12 (a padded target head): it never drafts ids 9-11, and after the
    target samples one it reads id 0 there (`ModelDrafter.readable`); the output is still the target's."""
    target, _ = models
    drafter = tiny_decoder("llama", seed=4, vocab=9, init=0.02)
    settings = LoopSettings(max_gen_len=3, gamma=2, eos_tokens_id=-1, first_target=False)
    runners = RememberingRunner(target), RememberingRunner(drafter)
    processor = PROCESSORS["multinomial"]
    torch.manual_seed(5)
    samples = [tuple(speculative_run(PROMPT, drafter, target, processor, settings, runners=runners).tokens)
               for _ in range(SAMPLES)]
    # A first token of 9-11 is the residual's (the drafter's first draft was rejected), so a second round drafted
    # after it: the case under test, in these samples.
    assert sum(s[0] >= 9 for s in samples) > 100
    assert chi_square_pvalue(samples, exact_distribution(target, processor, length=3)) > 1e-3


def test_confidence_stop_keeps_the_distribution(models):
    """Three tokens, gamma 2: the drafter's first distribution is below the threshold, so the first round drafts
    one token instead of two; the rounds change shape and the output distribution must not."""
    target, drafter = models
    processor = PROCESSORS["multinomial"]
    with torch.no_grad():
        first_top = float(processor(drafter(ids([PROMPT])).logits[0, -1]).max())
    settings = LoopSettings(max_gen_len=3, gamma=2, eos_tokens_id=-1, first_target=False)
    torch.manual_seed(2)
    samples, first_round = [], set()
    runners = RememberingRunner(target), RememberingRunner(drafter)
    for _ in range(SAMPLES):
        rounds = []
        result = speculative_run(PROMPT, drafter, target, processor, settings, on_round=rounds.append,
                                 confidence=first_top * 1.01, runners=runners)
        samples.append(tuple(result.tokens))
        first_round.add(len(rounds[0].drafts))
    assert first_round == {1}
    exact = exact_distribution(target, processor, length=3)
    assert chi_square_pvalue(samples, exact) > 1e-3


@pytest.mark.parametrize("rule", ["entropy", "learned"])
def test_draft_stop_rules_keep_the_distribution(models, rule, tmp_path):
    """The entropy rule (which stops every round after its first draft from this near-uniform drafter) and the
    learned rule (a random head, its stops weighed against pass times that vary from run to run): the rounds
    change shape, the output distribution must not."""
    from sampling import DraftStopConfig, make_draft_stop
    from sampling.acceptance_head import AcceptanceHead, drafter_identity, save_head

    target, drafter = models
    config = DraftStopConfig("entropy", entropy_bound=0.3)
    if rule == "learned":
        torch.manual_seed(6)
        save_head(AcceptanceHead(drafter.config.hidden_size, width=8), tmp_path / "head.pt", drafter_identity(drafter), {})
        config = DraftStopConfig("learned", head=str(tmp_path / "head.pt"))
    stop = make_draft_stop(config, drafter)
    if rule == "learned":
        # Pinned costs (its timings of these tiny passes made drafting look unprofitable: 9 drafts in 9000 rounds,
        # so the test sampled the target alone): a drafter step is cheap and a second row free, a third costly, so
        # the rule drafts, and stops after the first draft of each round where gamma is 2.
        stop.costs = PinnedCosts()
        stop.costs.draft, stop.costs.verify_by_width = 0.01, {1: 1.0, 2: 1.01, 3: 1.5}
    processor = PROCESSORS["topk"]
    settings = LoopSettings(max_gen_len=3, gamma=2, eos_tokens_id=-1, first_target=False)
    runners = RememberingRunner(target), RememberingRunner(drafter)
    torch.manual_seed(7)
    samples, lengths, drafted, kept = [], set(), 0, 0
    for _ in range(SAMPLES):
        rounds = []
        result = speculative_run(PROMPT, drafter, target, processor, settings, on_round=rounds.append, runners=runners,
                                 draft_stop=stop)
        samples.append(tuple(result.tokens))
        lengths.add(len(rounds[0].drafts))
        drafted, kept = drafted + result.drafted, kept + result.accepted
    assert lengths == {1}  # the rounds' shape: one draft where gamma allows two
    assert drafted >= SAMPLES and 0 < kept < drafted
    assert chi_square_pvalue(samples, exact_distribution(target, processor, length=3)) > 1e-3


class PinnedCosts(PassCosts):
    """Pass costs the learned rule reads but never re-times."""

    def observe_draft(self, seconds, steps):
        pass

    def observe_verify(self, width, seconds):
        pass


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_test_has_power(models, near, name):
    """Without the residual step (resampling from p after a rejection) the output is biased: the test sees it,
    under every processor (the near drafter: see `near`)."""
    target = models[0]
    torch.manual_seed(0)
    processor = PROCESSORS[name]
    samples = sample_speculative(target, near, processor, skip_adjustment=True)
    assert chi_square_pvalue(samples, exact_distribution(target, processor)) < 1e-6
