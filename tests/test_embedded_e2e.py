"""End to end on a real embedded model: loaded from its PyPI packages through the real loader (assembled,
checked and prepared or converted on first use), chat template applied, greedy AR, speculative decoding and NASD
compared; in the CPU default (native: the GGUF file's own precision) and in float32, the exactness reference.

The README's test command installs the model packages, so this runs in CI; a missing package fails here
with the loader's one-line message rather than being skipped.
"""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ngram_assisted import NGramStorage, nasd_run
from ngram_assisted.ngram_prior import prior_fingerprint, shipped_prior
from sampling import DraftStopConfig, LoopSettings, autoregressive_generate, autoregressive_run, speculative_run
from sampling.loop import model_eos
from sampling.acceptance_head import load_head
from utils.models.draft_vocab import DEFAULT_DRAFT_VOCAB, use_draft_vocab
from utils.models.model_loader import check_vocab_compatible, load_model, precision_summary

PROMPT = "Write a Python function that returns the factorial of n."
GEN = 24
# Without the cache every step is a pass over the whole sequence (~1 s each on a 2-core CPU against ~0.1 s with
# it): runs without the cache are compared with the cached answer's first OFF tokens.
OFF = 8


# Native loads name their kernels: timing every kernel on the real shapes took two minutes of a clean run here,
# and the measured choice has its own test (test_native_mode's test_auto_choice_is_measured_once_then_read_back).
KERNELS = "gguf"


@pytest.fixture(scope="module", params=["auto", "float32"])
def qwen(request):
    model, tokenizer = load_model("qwen2.5-coder-0.5b-instruct", device="cpu", dtype=request.param, kernels=KERNELS,
                                  progress=False)
    return model, tokenizer, *chat_prompt(tokenizer)


def chat_prompt(tokenizer) -> tuple[list[int], list[int]]:
    """PROMPT through the chat template, and the ids that end the answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    return list(ids), [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]


@pytest.fixture(scope="module")
def reference(qwen):
    model, tokenizer, ids, stop = qwen
    return autoregressive_run(ids, model, GEN, eos_tokens_id=stop, use_cache=True).tokens


def test_real_model_answers_sensibly(qwen, reference):
    model, tokenizer, ids, stop = qwen
    assert model.dtype == torch.float32  # the residual stream; native linear layers cast their own inputs
    text = tokenizer.decode(reference, skip_special_tokens=True)
    assert len(reference) == GEN
    assert "def" in text and "factorial" in text.lower(), text


def test_the_default_end_tokens_are_the_chats(qwen):
    """The README's library example passes no end tokens: the model's own (its config's) end the answer there."""
    model, tokenizer, _, stop = qwen
    assert set(model_eos(model)) == set(stop)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Reply with the one word yes."}],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    answer = autoregressive_generate(list(ids), model, GEN, use_cache=True)
    assert len(answer) < GEN and answer[-1] in stop, tokenizer.decode(answer)  # ended by the default


def test_cache_off_equals_cache_on(qwen, reference):
    model, _, ids, stop = qwen
    assert autoregressive_run(ids, model, OFF, eos_tokens_id=stop, use_cache=False).tokens == reference[:OFF]


def test_speculative_with_itself_accepts_everything(qwen, reference):
    model, _, ids, stop = qwen
    result = speculative_run(ids, model, model, settings=LoopSettings(GEN, 4, stop), use_cache=True)
    assert result.tokens == reference and result.acceptance_rate == 1.0


def test_speculative_with_a_different_drafter(qwen, reference):
    """A tiny random drafter sharing the vocabulary: nearly every draft is rejected, the output must not change."""
    model, tokenizer, ids, stop = qwen
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=model.config.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    drafter = Qwen2ForCausalLM(config).eval()
    check_vocab_compatible(model, tokenizer, drafter, tokenizer)
    for use_cache, length in ((False, OFF), (True, GEN)):
        result = speculative_run(ids, drafter, model, settings=LoopSettings(length, 3, stop), use_cache=use_cache)
        assert result.tokens == reference[:length]


def test_nasd_on_the_real_model(qwen, reference):
    model, _, ids, stop = qwen
    result = nasd_run(ids, NGramStorage(3, model.config.vocab_size), model, settings=LoopSettings(GEN, 4, stop),
                      use_cache=True)
    assert result.tokens == reference


def test_nasd_with_the_shipped_prior_on_the_real_model(qwen, reference):
    """The prior shipped for the embedded pair's tokenizer is found for it; it drafts where the prompt knows
    nothing (an answer's opening words) and the answer stays the greedy one."""
    model, tokenizer, ids, stop = qwen
    prior = shipped_prior(prior_fingerprint(tokenizer), model.config.vocab_size)
    assert prior is not None
    runs = [nasd_run(ids, NGramStorage(4, model.config.vocab_size), model, settings=LoopSettings(GEN, 6, stop),
                     use_cache=True, prior=p) for p in (None, prior)]
    assert runs[0].tokens == runs[1].tokens == reference
    assert runs[1].drafted > runs[0].drafted and runs[1].accepted > runs[0].accepted


def test_the_cpu_default_is_native_and_its_int4_drafter_keeps_the_answer():
    """In the default mode the model runs its file's low-bit weights; a re-quantised int4 copy of it drafts
    (lossy) and the output is still exactly the greedy answer."""
    model, tokenizer = load_model("qwen2.5-coder-0.5b-instruct", device="cpu", kernels=KERNELS, progress=False)
    drafter, _ = load_model("qwen2.5-coder-0.5b-instruct", device="cpu", kernels=KERNELS, int4_drafter=True,
                            progress=False)
    assert precision_summary(model).startswith("native (")
    # every linear layer reads 4-bit blocks: Q4_1 re-quantised where the file holds Q5_0/Q8_0/Q6_K, its own Q4_K
    counts = dict(part.split(" x") for part in precision_summary(drafter)[len("native ("):-1].split(", "))
    assert set(counts) <= {"Q4_1", "Q4_K", "int4"}
    assert sum(map(int, counts.values())) == 7 * model.config.num_hidden_layers + 1
    ids, stop = chat_prompt(tokenizer)
    reference = autoregressive_run(ids, model, GEN, eos_tokens_id=stop, use_cache=True).tokens
    for use_cache, length in ((False, OFF), (True, GEN)):
        result = speculative_run(ids, drafter, model, settings=LoopSettings(length, 4, stop), use_cache=use_cache)
        assert result.tokens == reference[:length] and result.acceptance_rate > 0.5
    # The shipped token ranking is for this tokenizer: the CLI's shortlist head applies, and keeps the answer.
    assert "head over 3277" in use_draft_vocab(drafter, tokenizer, DEFAULT_DRAFT_VOCAB)
    result = speculative_run(ids, drafter, model, settings=LoopSettings(GEN, 4, stop), use_cache=True)
    assert result.tokens == reference and result.acceptance_rate > 0.5
    # The shipped acceptance head was trained for this drafter: it loads, and its rule keeps the answer.
    learned = speculative_run(ids, drafter, model, settings=LoopSettings(GEN, 4, stop), use_cache=True,
                              draft_stop=DraftStopConfig("learned"))
    assert learned.tokens == reference


def test_the_shipped_acceptance_head_matches_the_drafter_in_either_mode(qwen):
    model = qwen[0]
    head = load_head(None, model)  # native and float32 loads of the same file share the norm's fingerprint
    assert head.provenance["drafter"] == "qwen2.5-coder-0.5b-instruct" and head.provenance["held_out"]["all"]
