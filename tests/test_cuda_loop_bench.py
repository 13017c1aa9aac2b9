"""benchmarks/cuda_loop.py on its tiny shape: both loops run, print their figures and give the same tokens (on the
device torch picks: the CPU here, a GPU where there is one)."""

import sys

from benchmarks import cuda_loop


def test_the_loop_benchmark_runs_and_both_loops_agree(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["cuda_loop", "--shape", "tiny", "--tokens", "8", "--repeats", "1"])
    cuda_loop.main()
    out = capsys.readouterr().out
    assert "8 new tokens" in out and "same tokens: True" in out
    lines = [line for line in out.splitlines() if "tokens/s" in line]
    assert len(lines) == 2 and lines[0].split()[0] == "transformers" and lines[1].split()[0] == "ours"
