"""benchmarks/acceptance_signals.py: each signal set reads the columns it names, aligned position by position."""

import pytest
import torch

from benchmarks.acceptance_signals import SETS, distribution, main, signals, table


def test_signals_align_the_past_and_the_targets_positions():
    drafter = torch.tensor([[0.9, 0.1, 0.3], [0.5, 0.4, 1.0], [0.7, 0.2, 0.6]])  # positions 0..2
    target = torch.tensor([[0.8, 0.1, 0.4], [0.6, 0.3, 0.9], [0.95, 0.0, 0.1], [0.5, 0.5, 0.7]])  # -1..2
    labels = torch.tensor([1.0, 0.0, 1.0])
    x = signals(drafter, target, labels)
    assert x.shape == (3, 11)
    assert x[:, :3].equal(drafter)
    assert x[:, 3].tolist() == [1.0, 1.0, 0.0]  # the previous draft was right (the first: taken as right)
    assert x[1, 4:7].equal(drafter[0]) and x[0, 4:7].equal(drafter[0])
    assert x[:, 7:9].equal(target[:3][:, [0, 2]])  # the target before each drafted position
    assert x[:, 9:11].equal(target[1:][:, [0, 2]])  # and at it


def test_distribution_reads_top_two_and_entropy():
    d = distribution(torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]]))
    assert torch.allclose(d, torch.tensor([[0.5, 0.5, 0.69314718]]))


def test_the_table_credits_the_signal_that_carries_the_labels():
    """Labels that only the target's distribution at the drafted position foresees: that set's AUC is near 1,
    the drafter's near 0.5."""
    torch.manual_seed(0)

    def answers(n):
        parts = []
        for _ in range(n):
            y = (torch.rand(80) < 0.7).float()
            drafter = torch.rand(80, 3)
            target = torch.rand(81, 3)
            target[1:, 0] = y * 0.5 + torch.rand(80) * 0.4  # the target's top probability at the draft
            parts.append((signals(drafter, target, y), y))
        return parts

    rows = table({"g": answers(6)}, {"g": answers(3)})
    cells = [float(c) for c in rows[2].strip("| ").split(" | ")[3:]]
    aucs = dict(zip(SETS, cells))
    assert aucs["+ target at the draft (bound)"] > 0.95
    assert 0.35 < aucs["drafter top probability"] < 0.65


def test_too_few_tokens_are_refused_before_any_loading(capsys):
    with pytest.raises(SystemExit):
        main(["--max-new-tokens", "1"])
    assert "--max-new-tokens must be at least 2" in capsys.readouterr().err
