"""benchmarks/cuda_loop.py on its tiny shape: both loops run, print their figures and give the same tokens (on the
device torch picks: the CPU here, a GPU where there is one)."""

import sys
from types import SimpleNamespace

import pytest

from benchmarks import cuda_loop


def test_the_loop_benchmark_runs_and_both_loops_agree(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["cuda_loop", "--shape", "tiny", "--tokens", "8", "--repeats", "1"])
    cuda_loop.main()
    out = capsys.readouterr().out
    assert "8 new tokens" in out and "same tokens: True" in out
    lines = [line for line in out.splitlines() if "tokens/s" in line]
    assert len(lines) == 2 and lines[0].split()[0] == "transformers" and lines[1].split()[0] == "ours"


def test_each_call_ends_once_the_device_is_done_and_keeps_its_tokens(monkeypatch):
    """A GPU runs ahead of the host: a turn's clock must stop only after the device is done with that loop's work,
    or the figure would be the host's alone."""
    log = []
    monkeypatch.setattr(cuda_loop, "synchronize", lambda device: log.append(("synchronized", device)))
    outputs = {}
    call = cuda_loop.synchronized("cuda:0", lambda: log.append("run") or [7, 8], outputs, "ours")
    call()
    assert log == ["run", ("synchronized", "cuda:0")] and outputs == {"ours": [7, 8]}


def test_the_figures_are_each_loops_best_turn_against_generates_and_different_tokens_are_refused(monkeypatch, capsys):
    """On fixed turns: tokens a second and ms a token from each loop's best (least) turn, the speed-up over
    generate()'s best; loops that give different tokens are refused, not reported."""
    def fixed(calls, repeats):
        for call in calls.values():
            call()
        return {"transformers generate()": [4.0, 2.0], "ours (autoregressive_run)": [1.0, 3.0]}

    monkeypatch.setattr(cuda_loop, "samples_in_turns", fixed)
    monkeypatch.setattr(sys, "argv", ["cuda_loop", "--shape", "tiny", "--tokens", "8", "--repeats", "2"])
    cuda_loop.main()
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if "tokens/s" in line]
    assert [line[-6:] for line in lines] == [["4.0", "tokens/s", "250.00", "ms/token", "1.00x", "generate()"],
                                             ["8.0", "tokens/s", "125.00", "ms/token", "2.00x", "generate()"]]
    real = cuda_loop.autoregressive_run
    monkeypatch.setattr(cuda_loop, "autoregressive_run", lambda *args, **kwargs: SimpleNamespace(
        tokens=[t + 1 for t in real(*args, **kwargs).tokens]))
    with pytest.raises(SystemExit, match="the two loops gave different tokens"):
        cuda_loop.main()
