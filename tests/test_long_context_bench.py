"""`python -m benchmarks.long_context`: its needle prompts, its policy switching and its rows, on a tiny model
(the real runs' figures are in benchmarks/RESULTS.md)."""

from argparse import Namespace

from benchmarks import long_context
from utils.caching import kv_budget, kv_policy


def tiny(tmp_path):
    """A byte-level tokenizer (source code round-trips, newlines included) with a chat template, and a tiny
    model that reads its ids."""
    from cli_models import CHAT_TEMPLATE
    from conftest import tiny_decoder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))} | {"<eos>": len(alphabet)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tiny_decoder("llama", seed=0, vocab=len(vocab), context=2048), tokenizer


def test_needle_prompts_bury_the_needle_at_their_depth(tmp_path):
    _, tokenizer = tiny(tmp_path)
    top, bottom = (tokenizer.decode(long_context.needle_prompt(tokenizer, 400, depth, 48213)) for depth in (0.1, 0.9))
    needle = long_context.NEEDLE.format(value=48213)
    assert needle in top and needle in bottom
    assert top.index(needle) < len(top) // 3 and bottom.index(needle) > len(bottom) // 2
    assert long_context.QUESTION in top


def test_policies_are_switched_and_every_run_is_a_row(tmp_path):
    model, tokenizer = tiny(tmp_path)
    long_context.set_policy([model], "snapkv", 64)
    assert kv_policy(model) == "snapkv" and kv_budget(model) == (48, 16)
    long_context.set_policy([model], None)
    assert kv_budget(model) is None and kv_policy(model) == "streaming"
    args = Namespace(lengths=[300], depths=[0.5], shares=[0.25], policies=["streaming", "snapkv"], answer=4)
    rows = long_context.needle_runs(model, tokenizer, args)
    assert [r["policy"] for r in rows] == ["full", "streaming", "snapkv"] and kv_budget(model) is None
    full, streaming, snap = rows
    assert full["agreement"] == 4 and all(0 <= r["agreement"] <= 4 for r in rows)  # answers of 4 tokens, no end
    assert streaming["budget"] == snap["budget"] == int(full["prompt_tokens"] * 0.25)
    # streaming evicts between the prompt's chunks; SnapKV must read the whole prompt before it chooses
    assert streaming["peak_kv_mib"] < snap["peak_kv_mib"] <= full["peak_kv_mib"]
    long_context.plot(rows, tmp_path / "retrieval.png")
    assert (tmp_path / "retrieval.png").stat().st_size > 1000


def test_window_runs_take_turns_from_one_length_to_the_next(tmp_path, monkeypatch):
    """Target AR always ran first at each new length (it paid what a new length costs first), the windows last:
    the order now alternates over lengths; the rows keep the table's order and each SD run equals AR."""
    model, tokenizer = tiny(tmp_path)
    order = []
    for name in ("autoregressive_run", "speculative_run"):
        real = getattr(long_context, name)
        monkeypatch.setattr(long_context, name, lambda *a, _real=real, **k: order.append(k.get("drafter_window"))
                            or _real(*a, **k))
    args = Namespace(window_lengths=[300, 400], windows=[16, 16], window_answer=4, gamma=2)  # a window given twice
    rows = long_context.window_runs(model, model, tokenizer, args)
    assert order == [None, 0, 16, 16, 0, None]
    assert [r["method"] for r in rows] == ["target AR", "SD full drafter", "SD window 16"] * 2
    assert all(r["equal_to_ar"] for r in rows)
