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
    # the target's distribution at the drafted position is known only after verifying: a rule's causal signals
    # (the target before the draft) must not read it, or the table credits a rule with foresight it cannot have
    assert 0.35 < aucs["+ target before"] < 0.65


def test_too_few_tokens_are_refused_before_any_loading(capsys):
    with pytest.raises(SystemExit):
        main(["--max-new-tokens", "1"])
    assert "--max-new-tokens must be at least 2" in capsys.readouterr().err


def test_the_drafters_past_set_reads_whether_the_previous_draft_was_right():
    """Runs of accepted and rejected drafts: only whether the previous draft was right foresees the next label,
    so the set with the drafter's past scores high and the drafter's distribution alone near chance."""
    torch.manual_seed(1)

    def answers(n):
        parts = []
        for _ in range(n):
            y = (torch.rand(8) < 0.5).float().repeat_interleave(10)  # 8 runs of 10 equal labels
            parts.append((signals(torch.rand(80, 3), torch.rand(81, 3), y), y))
        return parts

    rows = table({"g": answers(6)}, {"g": answers(3)})
    aucs = dict(zip(SETS, (float(c) for c in rows[2].strip("| ").split(" | ")[3:])))
    assert aucs["+ drafter's past"] > 0.85
    assert 0.35 < aucs["drafter distribution"] < 0.65


def test_the_scorers_are_fitted_on_the_training_answers_alone():
    """The AUC is a held-out figure: a scorer fitted on the held-out answers would grade its own answers. Here
    the training answers tie the label to the bound's column one way and the held-out ones the other way, so a
    scorer that learnt from the training answers alone ranks the held-out ones backwards."""
    torch.manual_seed(2)

    def answers(n, sign):
        parts = []
        for _ in range(n):
            y = (torch.rand(80) < 0.5).float()
            target = torch.rand(81, 3)
            target[1:, 0] = 0.5 + sign * (y - 0.5) * 0.5 + torch.rand(80) * 0.2
            parts.append((signals(torch.rand(80, 3), target, y), y))
        return parts

    rows = table({"g": answers(6, 1)}, {"g": answers(6, -1)})
    aucs = dict(zip(SETS, (float(c) for c in rows[2].strip("| ").split(" | ")[3:])))
    assert aucs["+ target at the draft (bound)"] < 0.05


def test_collect_labels_each_answer_position_with_the_draft_of_its_next_token(monkeypatch):
    """A label says whether the drafter's greedy draft at an answer position equals the target's next token, and
    the target's columns come from the position before the draft (causal) and the drafted one (the bound): an
    off-by-one would label each draft with its neighbour's token."""
    import sampling
    from types import SimpleNamespace

    from benchmarks import acceptance_signals
    from utils.chat import prompt_tokens

    ids, answer, vocab = [10, 11, 12], [20, 21, 22, 23], 32
    seq = ids + answer
    drafter_logits = torch.zeros(1, len(seq), vocab)
    for j in range(len(seq) - 1):  # right at even positions (it drafts the next token), wrong (token 0) at odd ones
        drafter_logits[0, j, seq[j + 1] if j % 2 == 0 else 0] = 5.0
    target_logits = torch.zeros(1, len(seq), vocab)
    target_logits[0, :, 0] = torch.arange(len(seq)).float()  # each position's top probability its own

    monkeypatch.setattr(prompt_tokens, "chat_ids", lambda tokenizer, text: list(ids))
    monkeypatch.setattr(sampling, "autoregressive_run", lambda *args: SimpleNamespace(tokens=list(answer)))
    models = SimpleNamespace(tokenizer=None, stop=[1], drafter_pass=lambda tokens: drafter_logits,
                             target=lambda input_ids: SimpleNamespace(logits=target_logits))
    (x, labels), = acceptance_signals.collect(models, {"g": ["p"]}, 4)["g"]
    assert labels.tolist() == [0.0, 1.0, 0.0]  # positions 3, 4, 5 draft 21, 22, 23: only position 4 right
    target = distribution(target_logits[0])
    assert torch.allclose(x[:, 7], target[2:5, 0]) and torch.allclose(x[:, 9], target[3:6, 0])


def test_main_fits_on_the_training_prompts_and_scores_the_held_out_ones(monkeypatch, capsys):
    """The held-out prompts must never be trained on (the AUC would flatter every set), and each set of answers
    is as long as its own flag asks."""
    import json
    from pathlib import Path

    from benchmarks import acceptance_signals, run

    collected = []
    monkeypatch.setattr(acceptance_signals, "Collector", lambda args: "models")
    monkeypatch.setattr(acceptance_signals, "data_source_args", lambda argv: None)
    monkeypatch.setattr(acceptance_signals, "collect",
                        lambda models, prompts, tokens: collected.append((prompts, tokens)) or {})
    monkeypatch.setattr(acceptance_signals, "table", lambda train, held: ["| row |"])
    monkeypatch.setattr(run, "machine", lambda: "m")
    main(["--train-tokens", "5", "--max-new-tokens", "7"])
    here = Path(acceptance_signals.HERE)
    (train, train_tokens), (held, held_tokens) = collected
    assert (train, train_tokens) == (json.loads((here / "train_prompts.json").read_text()), 5)
    assert (held, held_tokens) == (json.loads((here / "prompts.json").read_text()), 7)
    assert not {p for ps in train.values() for p in ps} & {p for ps in held.values() for p in ps}
