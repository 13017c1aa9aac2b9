"""benchmarks/pass_overhead.py on a tiny attention shape: it runs, prints a figure for both paths and finds them
the same bits."""

import pytest

from benchmarks import pass_overhead


def test_the_attention_table_runs_and_both_paths_agree(capsys):
    pass_overhead.main(["--skip-models", "--attention", "tiny-2x20"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.strip().startswith("tiny-2x20"))
    fast, plain = (float(x) for x in line.split(":")[1].split("same")[0].split("|"))
    assert fast > 0 and plain > 0 and line.endswith("same bits: True")


def test_a_batch_runs_its_op_the_given_number_of_times_and_the_table_prints_the_least_per_call(monkeypatch, capsys):
    """The attention figure is one call's microseconds: a turn's batch runs the op `calls` times, and the best
    (least) turn of each path is divided by that count; each path's figure is its own op's, and the two ops' outputs
    are compared (`same bits` says False where they differ)."""
    import torch

    count = []
    pass_overhead.batch_of(lambda: count.append(1), 7)()
    assert len(count) == 7
    ran = []
    monkeypatch.setattr(torch.ops.specdec, "attention", lambda q, k, v, scale: ran.append("fast") or q)
    monkeypatch.setattr(torch.ops.specdec, "attention_portable", lambda q, k, v, scale: ran.append("plain") or q + 1)

    def fixed(calls, repeats):
        for way, call in calls.items():
            ran.clear()
            call()
            assert ran == [way] * 1250  # tiny-2x20: 200000 // (4 heads * 2 rows * 20 keys) calls a batch
        return {"fast": [0.5, 0.25, 1.0], "plain": [2.0, 1.0, 3.0]}

    monkeypatch.setattr(pass_overhead, "samples_in_turns", fixed)
    pass_overhead.attention_table(["tiny-2x20"])
    assert capsys.readouterr().out.splitlines()[-1] == "  tiny-2x20: 200.0 | 800.0  same bits: False"


def test_timed_ops_add_up_the_seconds_inside_every_call(monkeypatch):
    """The part of a pass spent outside our ops is the pass's time less `inside`: every call's seconds must add up
    (also a call that raises), whichever op it is."""
    from types import SimpleNamespace

    clock = iter([0.0, 1.0, 10.0, 12.0, 20.0, 24.0])
    monkeypatch.setattr(pass_overhead, "time", SimpleNamespace(perf_counter=lambda: next(clock)))

    def fails():
        raise RuntimeError("no")

    timed = pass_overhead.TimedOps(SimpleNamespace(a=lambda x: x + 1, b=fails))
    assert timed.a(1) == 2 and timed.a(2) == 3
    with pytest.raises(RuntimeError):
        timed.b()
    assert timed.inside == 1.0 + 2.0 + 4.0


def test_the_passes_take_turns_each_way_and_leave_the_switch_as_it_was(monkeypatch, capsys):
    """`pass_table` on tiny models: each way of the switch runs its turns of 30 passes with the flag set to it, the
    ways taking turns (every other turn reversed), every pass on the same 200 held positions; the untimed turns are
    left out of the printed figures, and the flag is back as it was afterwards. On a clock that ticks once a read,
    each figure is a pass's time, and the bracket the part of it outside the ops the model calls through
    `qkernels.ops()` (what the switch can change outside the products)."""
    from types import SimpleNamespace

    import torch

    from conftest import tiny_decoder
    from utils.models import draft_vocab, lean_forward, model_loader
    from utils.models.kernel_choice import WARMUP

    models = {"drafter": tiny_decoder(vocab=1000, context=256).float().cpu(),  # the tool draws ids under 1000
              "target": tiny_decoder(seed=1, vocab=1000, context=256).float().cpu()}
    monkeypatch.setattr(model_loader, "load_model", lambda spec, **kwargs: (
        models["drafter" if spec == model_loader.DEFAULT_DRAFTER else "target"], None))
    monkeypatch.setattr(draft_vocab, "use_draft_vocab", lambda *args: None)
    monkeypatch.setattr(lean_forward, "STACKED", "as it was")
    from utils.models import qkernels

    ticks = iter(range(10**6))
    monkeypatch.setattr(pass_overhead, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    monkeypatch.setattr(torch.ops.specdec, "noop", lambda: None, raising=False)
    seen = {name: [] for name in models}

    def pass_starts(module, args, kwargs, name):  # one op call a pass: 1 tick inside it, 1 outside
        seen[name].append((lean_forward.STACKED, kwargs["past_key_values"].get_seq_length()))
        qkernels.ops().noop()

    for name, model in models.items():
        model.register_forward_pre_hook(lambda module, args, kwargs, name=name: pass_starts(module, args, kwargs, name),
                                        with_kwargs=True)
    pass_overhead.pass_table([1], 2, "stacked")
    assert lean_forward.STACKED == "as it was"
    for name in models:
        passes = seen[name][1:]  # after the 200 positions' prefill
        turns = [passes[i : i + 30] for i in range(0, len(passes), 30)]
        assert [turn[0][0] for turn in turns] == [False, True, True, False] * ((WARMUP + 2) // 2)
        assert all(len(set(turn)) == 1 and turn[0][1] == 200 for turn in turns)
    rows = [line for line in capsys.readouterr().out.splitlines() if "row(s)" in line]
    # two timed figures a way: 30 passes of 2 ticks and the closing read, 1 tick a pass inside the op
    figure = f"{61 / 30 * 1e3:.2f} ({31 / 30 * 1e3:.2f})"
    assert [row.split(": ", 1)[1] for row in rows] == [f"{figure} {figure} | {figure} {figure}"] * 2
