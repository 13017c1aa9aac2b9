"""prune_cache: every supported format, N = 0, the errors, and equal logits after a prune."""

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache, Qwen2Config, Qwen2ForCausalLM, StaticCache

from conftest import TEST_DEVICE, decoder_config, ids, tiny_decoder, tiny_encoder_decoder
from utils.caching import cache_length, new_cache, prune_cache

SEQ = ids([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]])  # longer than mistral's window of 8


@torch.no_grad()
def check_pruned_cache_continues(model, cache, keep: int):
    """Fills `cache` with SEQ, prunes back to `keep` positions, feeds SEQ[keep] and compares the logits with a
    fresh forward over SEQ[:keep+1]."""
    model(input_ids=SEQ, past_key_values=cache, use_cache=True)
    assert cache_length(cache) == SEQ.shape[1]
    pruned = prune_cache(cache, SEQ.shape[1] - keep)
    assert pruned is cache  # pruned in place
    assert cache_length(cache) == keep
    step = model(input_ids=SEQ[:, keep : keep + 1], past_key_values=cache, use_cache=True).logits[0, -1]
    fresh = model(input_ids=SEQ[:, : keep + 1]).logits[0, -1]
    torch.testing.assert_close(step, fresh, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt", "gpt_neox", "qwen2", "mistral"])
@pytest.mark.parametrize("keep", [3, 9, 13])
def test_dynamic_cache_prune_then_continue(arch, keep):
    model = tiny_decoder(arch)
    check_pruned_cache_continues(model, new_cache(model), keep)


def test_plain_dynamic_cache_without_config():
    model = tiny_decoder("llama")
    check_pruned_cache_continues(model, DynamicCache(), 4)


@pytest.mark.parametrize("keep", [2, 10])
def test_static_cache_rolls_back_by_position(keep):
    model = tiny_decoder("llama")
    cache = StaticCache(config=model.config, max_cache_len=32)
    check_pruned_cache_continues(model, cache, keep)


def test_encoder_decoder_cache_prunes_self_attention_only():
    model = tiny_encoder_decoder("t5")
    enc = model.get_encoder()(input_ids=SEQ)
    cache = new_cache(model)
    assert isinstance(cache, EncoderDecoderCache)
    with torch.no_grad():
        model(encoder_outputs=enc, decoder_input_ids=SEQ[:, :10], past_key_values=cache, use_cache=True)
        cross_before = cache.cross_attention_cache.get_seq_length()
        prune_cache(cache, 4)
        assert cache.get_seq_length() == 6
        assert cache.cross_attention_cache.get_seq_length() == cross_before
        step = model(encoder_outputs=enc, decoder_input_ids=SEQ[:, 6:7], past_key_values=cache, use_cache=True).logits[0, -1]
        fresh = model(encoder_outputs=enc, decoder_input_ids=SEQ[:, :7]).logits[0, -1]
    torch.testing.assert_close(step, fresh, rtol=1e-9, atol=1e-9)


def test_legacy_tuple_returns_new_truncated_tuple():
    k = torch.randn(1, 2, 7, 4)
    legacy = ((k, k.clone()), (k.clone(), k.clone()))
    out = prune_cache(legacy, 3)
    assert out is not legacy and isinstance(out, tuple)
    assert all(t.shape[-2] == 4 for layer in out for t in layer)
    assert legacy[0][0].shape[-2] == 7  # the input is untouched
    torch.testing.assert_close(out[0][0], k[..., :4, :])


@pytest.mark.parametrize("cache", [((),), (1,), ((torch.zeros(1, 1, 2, 4),),), ([torch.zeros(1, 1, 2, 4)] * 2,)])
def test_a_malformed_legacy_tuple_is_a_value_error(cache):
    with pytest.raises(ValueError, match="a legacy cache is a tuple of per-layer"):
        prune_cache(cache, 1)  # was IndexError or TypeError from deep inside


def test_legacy_encoder_decoder_tuple_keeps_cross_attention():
    self_kv, cross = torch.randn(1, 2, 7, 4), torch.randn(1, 2, 11, 4)
    out = prune_cache(((self_kv, self_kv, cross, cross),), 2)
    assert out[0][0].shape[-2] == 5 and out[0][2].shape[-2] == 11


def test_none_and_zero():
    assert prune_cache(None, 3) is None
    model = tiny_decoder("llama")
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=SEQ[:, :5], past_key_values=cache, use_cache=True)
    assert prune_cache(cache, 0) is cache and cache_length(cache) == 5
    legacy = ((torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2)),)
    assert prune_cache(legacy, 0) is legacy


@pytest.mark.parametrize("n", [-1, 6])
def test_bad_counts_raise(n):
    model = tiny_decoder("llama")
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=SEQ[:, :5], past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError):
        prune_cache(cache, n)
    with pytest.raises(ValueError):
        prune_cache(((torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2)),), n)


def test_unsupported_types_raise_naming_the_type():
    with pytest.raises(ValueError, match="dict"):
        prune_cache({}, 1)
    model = tiny_decoder("mistral")
    static_sliding = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(input_ids=SEQ[:, :5], past_key_values=static_sliding, use_cache=True)
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer"):
        prune_cache(static_sliding, 1)


def test_sliding_cache_past_its_window_without_recording_is_refused():
    model = tiny_decoder("mistral")
    cache = DynamicCache(config=model.config)  # not recording the past
    with torch.no_grad():
        model(input_ids=SEQ, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="new_cache"):
        prune_cache(cache, 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_growing_cache_gives_the_dynamic_caches_tensors_and_rolls_back(arch):
    """GrowingCache fills buffers in place: the same keys and values as DynamicCache through passes of several
    widths, prunes and growth past its first capacity, and the same logits."""
    from utils.caching import MIN_ROOM, GrowingCache, GrowingLayer

    model = tiny_decoder(arch)
    growing, dynamic = GrowingCache(model.config), DynamicCache(config=model.config)
    assert all(type(layer) is GrowingLayer for layer in growing.layers)
    steps = [(SEQ, 0), (SEQ[:, :3], 2), (SEQ[:, :1], 0), (SEQ[:, 4:8], 4), (SEQ[:, :5], 1)]
    steps += [(ids([[5 + i % 50] * (MIN_ROOM // 2)]), 3) for i in range(4)]  # past the first capacity, twice
    with torch.no_grad():
        for chunk, discard in steps:
            a = model(input_ids=chunk, past_key_values=growing, use_cache=True).logits
            b = model(input_ids=chunk, past_key_values=dynamic, use_cache=True).logits
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
            for mine, theirs in zip(growing.layers, dynamic.layers):
                assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
            prune_cache(growing, discard), prune_cache(dynamic, discard)
            assert cache_length(growing) == cache_length(dynamic)
    room = growing.layers[0].room[0]
    assert room.shape[-2] >= cache_length(growing) + 1 and growing.layers[0].keys.data_ptr() == room.data_ptr()


def test_native_models_get_a_growing_cache_and_others_a_dynamic_one():
    from utils.caching import GrowingCache

    model = tiny_decoder("llama")
    assert type(new_cache(model)) is DynamicCache
    model.reads_strided_cache = True
    assert type(new_cache(model)) is GrowingCache


def test_a_sliding_rollback_past_what_the_window_recorded_is_refused():
    """transformers' sliding layer crops to its last `window - 1` entries and records only what is fed after: a
    second rollback with no pass between left fewer entries than its length claimed, and the next pass failed
    inside transformers ("The size of tensor a (7) must match the size of tensor b (8)")."""
    from utils.caching import SlidingRollbackError

    model = tiny_decoder("mistral")  # a window of 8
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=SEQ, past_key_values=cache, use_cache=True)  # 14 positions, all recorded
        prune_cache(cache, 2)  # 12 positions: 7 held, what a next pass sees
        model(input_ids=SEQ[:, 12:14], past_key_values=cache, use_cache=True)  # 14: 9 held, 2 recorded
        with pytest.raises(SlidingRollbackError, match="cannot discard 3 positions from a sliding window of 8: it "
                                                       "recorded 2 since its last rollback"):
            prune_cache(cache, 3)
        assert cache_length(cache) == 14  # refused before any layer was cut
    check_pruned_cache_continues(model, new_cache(model), 5)  # within what was recorded: exact, as before


@pytest.mark.parametrize("arch", ["mistral", "qwen2-sliding"])
def test_kept_runners_of_a_sliding_window_model_answer_every_turn_as_fresh_ones(arch):
    """A sweep: the same prompt twice, a shorter or edited one, through runners kept from the turn before (the
    chat's --cache), crashed AR, SD and NASD on every sliding-window model (and once answered wrong tokens)."""
    from ngram_assisted import NGramStorage, nasd_run
    from sampling import autoregressive_run, speculative_run
    from sampling.loop import LoopSettings
    from utils.logits_processor import GreedyProcessor
    from utils.model_runner import ModelRunner

    def model(seed):
        if arch == "mistral":
            return tiny_decoder("mistral", seed)
        _, plain = decoder_config("qwen2")  # its second layer slides, its first attends to everything
        config = Qwen2Config(**{**plain.to_dict(), "use_sliding_window": True, "sliding_window": 8,
                                "max_window_layers": 1, "layer_types": None})
        assert config.layer_types == ["full_attention", "sliding_attention"]
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).double().eval().to(TEST_DEVICE)

    target, drafter = model(0), model(1)
    prompt = [5 + i % 40 for i in range(20)]  # past the window of 8
    turns = [prompt, prompt, prompt[:15], prompt + [3, 4, 5], prompt[:5] + [7] + prompt[6:]]
    settings = LoopSettings(max_gen_len=10, eos_tokens_id=None, gamma=3)
    kept = {"ar": ModelRunner(target, use_cache=True), "sd": (ModelRunner(target, use_cache=True),
            ModelRunner(drafter, use_cache=True)), "nasd": ModelRunner(target, use_cache=True)}
    for turn in turns:
        fresh = autoregressive_run(turn, target, 10, GreedyProcessor(), None, True).tokens
        assert autoregressive_run(turn, target, 10, GreedyProcessor(), None, True, runner=kept["ar"]).tokens == fresh
        assert speculative_run(turn, drafter, target, GreedyProcessor(), settings, use_cache=True,
                               runners=kept["sd"]).tokens == fresh
        assert nasd_run(turn, NGramStorage(3, 64), target, GreedyProcessor(), settings, use_cache=True,
                        runner=kept["nasd"]).tokens == fresh


def test_sliding_layers_hold_a_window_through_rounds_without_a_rejection():
    # recording the past kept every entry until a rejection's crop: plain decoding held 63 entries a layer for a
    # window of 8, as much as full attention
    from sampling import autoregressive_run
    from utils.logits_processor import GreedyProcessor
    from utils.model_runner import ModelRunner

    model = tiny_decoder("mistral")  # sliding window 8
    runner = ModelRunner(model, use_cache=True)
    tokens = autoregressive_run([5, 6, 7, 8], model, 60, GreedyProcessor(), None, True, runner=runner).tokens
    assert tokens == autoregressive_run([5, 6, 7, 8], model, 60, GreedyProcessor(), None, True).tokens
    held = [layer.keys.shape[-2] for layer in runner.cache.layers]
    assert runner.cached == 63 and max(held) <= model.config.sliding_window  # the window, plus the last pass's row


@torch.no_grad()
def test_a_pass_cut_short_between_two_layers_is_not_recovered():
    # recover() cut every layer by what layer 0 held past the count, so the later layers lost counted entries; it
    # said yes, the chat kept the runner, and the next turn failed on a shape mismatch
    from utils.model_runner import ModelRunner

    model = tiny_decoder("llama")
    seq = torch.tensor([[5 + i % 30 for i in range(40)]], device=TEST_DEVICE)
    runner = ModelRunner(model, use_cache=True)
    runner.logits(seq[:, :20], 1)

    def ctrl_c(module, args, kwargs):
        raise KeyboardInterrupt

    hook = model.model.layers[1].register_forward_pre_hook(ctrl_c, with_kwargs=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.logits(seq[:, :30], 1)
    finally:
        hook.remove()
    assert runner.cached == 20 and [layer.get_seq_length() for layer in runner.cache.layers] == [30, 20]
    assert not runner.recover()  # the caller starts over


@torch.no_grad()
def test_a_kept_runner_whose_last_pass_failed_answers_as_a_fresh_one():
    # the layers had written the failed pass's entries, which the count did not know: the next turn read them as
    # its own positions and answered other tokens than a fresh runner
    from ngram_assisted import NGramStorage, nasd_run
    from sampling import autoregressive_run
    from sampling.loop import LoopSettings
    from utils.logits_processor import GreedyProcessor
    from utils.model_runner import ModelRunner

    model = tiny_decoder("llama")
    prompt = [5 + i % 30 for i in range(20)]
    settings = LoopSettings(8, 3, None)
    runner = ModelRunner(model, use_cache=True)
    nasd_run(prompt, NGramStorage(3, 64), model, GreedyProcessor(), settings, use_cache=True, runner=runner)

    def out_of_memory(module, args, kwargs):
        raise RuntimeError("out of memory")

    hook = model.lm_head.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            nasd_run(prompt + [9, 9, 9], NGramStorage(3, 64), model, GreedyProcessor(), settings, use_cache=True,
                     runner=runner)
    finally:
        hook.remove()
    turn = prompt + [9, 9, 9]
    fresh = autoregressive_run(turn, model, 8, GreedyProcessor(), None, True).tokens
    assert nasd_run(turn, NGramStorage(3, 64), model, GreedyProcessor(), settings, use_cache=True,
                    runner=runner).tokens == fresh


def test_a_second_rollback_at_exactly_the_window_is_refused():
    """A sliding layer whose length equals its window (8) holds 7 entries after a rollback: a second rollback with no
    pass between is past what it recorded (SlidingRollbackError), and a cache that does not record the past is
    refused with our ValueError, not transformers' RuntimeError. The boundary of check_sliding_rollback's `>=`."""
    from utils.caching import SlidingRollbackError

    model = tiny_decoder("mistral")  # a window of 8
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=SEQ[:, :9], past_key_values=cache, use_cache=True)
        prune_cache(cache, 1)  # 8 positions, the window: 7 held
        with pytest.raises(SlidingRollbackError, match="cannot discard 2 positions"):
            prune_cache(cache, 2)
        assert cache_length(cache) == 8
        plain = DynamicCache(config=model.config)  # not recording the past
        model(input_ids=SEQ[:, :8], past_key_values=plain, use_cache=True)  # exactly the window
        with pytest.raises(ValueError, match="new_cache"):
            prune_cache(plain, 1)


def test_reuse_returns_the_positions_kept_for_a_prompt_inside_what_was_read():
    from sampling import autoregressive_run
    from utils.model_runner import ModelRunner

    model = tiny_decoder("llama")
    runner = ModelRunner(model, use_cache=True)
    prompt = [5 + i % 30 for i in range(20)]
    autoregressive_run(prompt, model, 5, eos_tokens_id=None, use_cache=True, runner=runner)
    assert runner.reuse(prompt[:7]) == 7 and runner.cached == 7 and cache_length(runner.cache) == 7
