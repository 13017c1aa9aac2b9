"""The benchmark's command line: narrowing it to prompt groups and methods, and refusing unknown groups early
(before minutes of model loading)."""

import pytest

from benchmarks.run import parse_args


def test_groups_default_to_all_and_can_be_narrowed():
    assert parse_args([]).groups == ["code-writing", "code-editing", "chat"]
    assert parse_args(["--groups", "chat,code-editing"]).groups == ["chat", "code-editing"]


def test_unknown_group_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--groups", "poems"])
    assert exit_.value.code == 2
    assert "unknown poems; known: code-writing, code-editing, chat" in capsys.readouterr().err


def test_quick_is_short():
    args = parse_args(["--quick"])
    assert (args.prompts_per_group, args.gammas, args.repeats, args.cache_off_prompts) == (1, [2, 4, 8], 1, 0)
