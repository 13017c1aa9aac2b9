"""How the kernel choice times and compares its contenders (`samples_in_turns`, `time_in_turns`, `cycling`, the
cold bound of `measure`, `pick`'s weights): tests found missing by a mutation review. Time is a fake clock here,
so each assertion is about what the code does with the times, not about this host's speed."""

import types

import torch

from utils.models import kernel_choice, qkernels
from utils.models.model_loader import cache_root


def fake_clock(monkeypatch, durations: dict[str, list[float]]):
    """`kernel_choice.time.perf_counter` as a clock that each `calls[name]()` (made by the returned function)
    advances by the next of `durations[name]`."""
    now = [0.0]
    monkeypatch.setattr(kernel_choice, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    left = {name: list(d) for name, d in durations.items()}

    def call(name):
        def run():
            now[0] += left[name].pop(0)
        return run

    return {name: call(name) for name in durations}, left


def test_the_timed_samples_are_those_after_the_warm_up_rounds_each_call_timed_alone(monkeypatch):
    warm = [1000.0 + i for i in range(kernel_choice.WARMUP)]  # untimed: far slower, as a cold first call is
    durations = {"a": warm + [1.0, 2.0, 3.0, 4.0], "b": warm + [10.0, 20.0, 30.0, 40.0]}
    calls, left = fake_clock(monkeypatch, durations)
    samples = kernel_choice.samples_in_turns(calls, repeats=4)
    assert samples == {"a": [1.0, 2.0, 3.0, 4.0], "b": [10.0, 20.0, 30.0, 40.0]}
    assert left == {"a": [], "b": []}  # WARMUP + repeats calls each, no more


def test_time_in_turns_takes_the_median_of_the_timed_calls(monkeypatch):
    """REPEATS timed calls (even: the upper of the two middle ones), after warm-up calls far slower; the samples come
    in decreasing order, so neither the first, the last nor the middle one as it came is the median."""
    repeats = len(kernel_choice.samples_in_turns({"x": lambda: None})["x"])  # time_in_turns' own count
    warm = [1000.0] * kernel_choice.WARMUP
    timed = [float(v) for v in range(repeats, 0, -1)]  # repeats .. 1
    calls, _ = fake_clock(monkeypatch, {"x": warm + timed, "y": warm + [2 * v for v in timed]})
    median = sorted(timed)[repeats // 2]
    assert median != timed[repeats // 2]
    assert kernel_choice.time_in_turns(calls) == {"x": median, "y": 2 * median}


def test_cycling_runs_each_copy_in_turn_on_the_one_input():
    seen = []
    modules = [lambda x, i=i: seen.append((i, x)) for i in range(3)]
    x = torch.zeros(2, 4)
    call = kernel_choice.cycling(modules, x)
    for _ in range(7):
        call()
    assert [i for i, _ in seen] == [0, 1, 2, 0, 1, 2, 0]
    assert all(y is x for _, y in seen)


def test_a_kernel_within_near_tie_of_the_leaders_bound_is_timed_wider(monkeypatch):
    """The cold bound keeps a kernel whose one-row call is within NEAR_TIE of the fastest's weighted pass (1.25 here,
    gguf: 1.0 + 0.25 * 1.0): gguf8 at 1.3 is timed at 9 rows, gguf8 at 1.5 (> 1.15 * 1.25) is not."""
    assert qkernels.ensure(cache_root()), qkernels.why()
    for other, kept in ((1.3, True), (1.5, False)):
        fake = {"gguf": 1.0, "gguf8": other}
        monkeypatch.setattr(kernel_choice, "time_in_turns", lambda calls: {k: fake[k] for k in calls})
        timings = kernel_choice.measure(kernel_choice.Shape("Q4_K", 16, 256), candidates=("gguf", "gguf8"))
        expected = {"gguf": {1: 1.0, 9: 1.0}, **({"gguf8": {1: other, 9: other}} if kept else {})}
        assert timings == expected, other


def test_every_kernel_of_a_shape_is_timed_on_the_same_input_at_each_width(monkeypatch):
    """Our kernels reuse the activation blocks of the input quantised last (`quantise_shared`): an input per kernel
    would make each timing depend on which kernel ran before it."""
    assert qkernels.ensure(cache_root()), qkernels.why()
    seen, real = [], kernel_choice.cycling
    monkeypatch.setattr(kernel_choice, "cycling", lambda modules, x: seen.append(x) or real(modules, x))
    fake = {"gguf": 1.0, "gguf8": 1.05}
    monkeypatch.setattr(kernel_choice, "time_in_turns", lambda calls: {k: fake[k] for k in calls})
    timings = kernel_choice.measure(kernel_choice.Shape("Q4_K", 16, 256), candidates=("gguf", "gguf8"))
    assert set(timings) == set(fake) and all(set(t) == {1, 9} for t in timings.values())
    for rows in (1, 9):
        inputs = [x for x in seen if x.shape[0] == rows]
        assert len(inputs) > len(fake) and all(x is inputs[0] for x in inputs), rows


def test_each_timed_copy_of_a_layer_holds_its_own_weights(monkeypatch):
    """The copies overflow the last-level cache only if each reads other memory: the file layout's module keeps
    the form's tensor as it is, so copies of one form would be one hot weight."""
    assert qkernels.ensure(cache_root()), qkernels.why()
    made, real = [], kernel_choice.make_linear
    monkeypatch.setattr(kernel_choice, "make_linear", lambda form, k: made.append(real(form, k)) or made[-1])
    monkeypatch.setattr(kernel_choice, "time_in_turns", lambda calls: {k: 1.0 for k in calls})
    kernel_choice.measure(kernel_choice.Shape("Q4_K", 16, 256), candidates=("gguf",))
    pointers = [m.blocks.data_ptr() for m in made]
    assert len(made) == kernel_choice.MAX_COPIES and len(set(pointers)) == len(made)


def test_pick_weighs_each_width_by_its_weight():
    """gguf: 1.0 at one row, 3.0 at nine (weighted 1.75); gguf8: 1.3 and 2.0 (1.8). Weighted, the two are a near
    tie of one memory class and the faster, gguf, wins; counted alike (4.0 against 3.3) gguf8 would."""
    from utils.models.kernel_choice import TARGET_WIDTHS, pick

    ms = {"gguf": {"1": 1.0, "9": 3.0}, "gguf8": {"1": 1.3, "9": 2.0}}
    assert TARGET_WIDTHS == {1: 1.0, 9: 0.25}
    assert pick(ms, TARGET_WIDTHS) == "gguf"
    assert pick(ms, {1: 1.0, 9: 1.0}) == "gguf8"
