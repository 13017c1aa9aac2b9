"""The benchmark tools' command lines as a user meets them: what they refuse before minutes of loading, in one line
with status 2, and what they write. Each case was found by a sweep of the tools; the comment says what it did
before."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import cli, draft_replay, draft_stop_ab, issue_rate, train_acceptance_head
from benchmarks.run import parse_args

ROOT = Path(__file__).resolve().parents[1]


def refused(parse, argv, capsys) -> str:
    """The one-line error of `parse(argv)`, which must end the program with status 2."""
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty-group.json").write_text(json.dumps({"chat": ["Hi"], "code": []}))
    (tmp_path / "list.json").write_text("[]")
    return tmp_path


def test_a_group_without_prompts_is_refused_by_every_reader(files, capsys):
    # `python -m benchmarks` loaded and warmed every model, then wrote an empty table and exited 0
    assert refused(parse_args, ["--prompts", str(files / "empty-group.json")], capsys).endswith(
        "empty-group.json: group 'code' has no prompts")
    # draft_stop_ab checked only that the file existed: a traceback after the models' warm-up
    for name, message in (("empty-group.json", "group 'code' has no prompts"),
                          ("list.json", "expected a JSON object of prompt groups")):
        assert message in refused(draft_stop_ab.parse_args, ["--prompts", str(files / name)], capsys)
    # the head's trainer: AttributeError on a list, after loading
    assert "expected a JSON object of prompt groups" in refused(
        train_acceptance_head.parse_args, ["--prompts", str(files / "list.json")], capsys)
    with pytest.raises(ValueError, match="groups 'a', 'b' have no prompts"):
        (files / "two.json").write_text(json.dumps({"a": [], "b": []}))
        cli.read_prompts(None, str(files / "two.json"))


def test_a_value_given_twice_runs_once(capsys):
    # --gammas 2,2 ran ours-sd-g2 twice a repeat and stored two runs of one prompt
    args = parse_args(["--gammas", "2,2,3", "--entropy-bounds", "0.5,0.50", "--methods", "ours-ar"])
    assert args.gammas == [2, 3] and args.entropy_bounds == [0.5]
    assert draft_stop_ab.parse_args(["--confidences", "0.4,0.4"]).confidences == [0.4]


def test_a_tilde_in_out_is_the_home_folder(tmp_path, monkeypatch):
    # `--out=~/x` (no shell expansion after `=`) made a folder named `~` in the working directory
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert parse_args(["--out=~/results", "--methods", "ours-ar"]).out == str(tmp_path / "results")
    assert (tmp_path / "results").is_dir() and not (tmp_path / "~").exists()
    assert train_acceptance_head.parse_args(["--out", "~/heads/h.pt"]).out == str(tmp_path / "heads" / "h.pt")


def test_a_refused_command_leaves_no_out_folder(tmp_path, capsys):
    # the folder was made before --processor was checked
    out = tmp_path / "never"
    assert "sampling compares our methods only" in refused(
        parse_args, ["--out", str(out), "--processor", "nucleus 0.7 0.9", "--methods", "hf-generate"], capsys)
    assert not out.exists()


def test_the_heads_trainer_checks_its_out_file_and_its_split_before_loading(tmp_path, capsys):
    # --out was only written after minutes of collecting; a folder there failed at the end
    assert f"--out: {tmp_path} is a folder; give a file's path" in refused(
        train_acceptance_head.parse_args, ["--out", str(tmp_path)], capsys)
    # more validation prompts than a group has: torch.cat's "expected a non-empty list of Tensors"
    assert "--validation-per-group: every group of --prompts needs a prompt to train on beside the 8 kept for " \
           "validation; its smallest group has 8" in refused(
        train_acceptance_head.parse_args, ["--validation-per-group", "8"], capsys)
    assert "--held-out: cannot read /no/such.json" in refused(  # each prompt file named by its own flag
        train_acceptance_head.parse_args, ["--held-out", "/no/such.json"], capsys)
    assert train_acceptance_head.parse_args(["--out", str(tmp_path / "h.pt")]).validation_per_group == 2
    # the tools that collect the same records write no head: nothing is checked for one
    assert train_acceptance_head.data_args(["--out", "/proc/no/head.pt"]).max_new_tokens == 96


def test_each_tool_refuses_what_it_cannot_run_before_loading(capsys):
    from benchmarks import kernel_ab, layer_kernels, long_context, native_vs_f32, ngram_cache, ngram_prior, \
        pass_overhead, turns

    cases = [
        # each ran the whole benchmark, then failed writing its table
        (turns.main, ["--out", "/proc/no/results"], "--out: cannot make /proc/no/results"),
        (native_vs_f32.main, ["--out", "/proc/no/results"], "--out: cannot make /proc/no/results"),
        (ngram_cache.main, ["--out", "/proc/no/results"], "--out: cannot make /proc/no/results"),
        # KeyError tracebacks after loading and warming up the model
        (ngram_cache.main, ["--groups", "nosuch"], "argument --groups: unknown nosuch; known: code-writing"),
        (pass_overhead.main, ["--skip-models", "--attention", "bogus"], "argument --attention: unknown bogus"),
        # more turns than follow-ups: ran 8 and said 9
        (ngram_cache.main, ["--turns", "9"], "--turns: at most 8"),
        # all eight follow-ups is a valid conversation: only the unwritable --out is refused
        (ngram_cache.main, ["--turns", "8", "--out", "/proc/no/results"], "--out: cannot make /proc/no/results"),
        # a window under the sinks failed after the needle test and the plain runs, leaving a partial file
        (long_context.main, ["--windows", "1"], "argument --windows: expected an integer >= 8, got '1'"),
        (long_context.main, ["--depths", "1.5"], "argument --depths: a depth is from 0 (the top) to 1 (the bottom), got 1.5"),
        (long_context.main, ["--shares", "0.001"], "--shares: 0.001 of a 1024-token prompt is under the 8 positions"),
        # the smallest share decides, wherever it is in the list
        (long_context.main, ["--shares", "0.5", "0.001", "--out", "/proc/no/results"],
         "--shares: 0.001 of a 1024-token prompt is under the 8 positions"),
        # git read the revision as its own option and printed its usage
        (kernel_ab.parse_args, ["--base=--output=x"], "--base: '--output=x' is not a git revision"),
        (kernel_ab.parse_args, ["--base", "HEAD", "--base-flags", "'"], "--base-flags: No closing quotation"),
        # flags that did nothing were accepted silently
        (layer_kernels.main, ["--x8"], "--x8 goes with --paths or --pass"),
        (ngram_prior.main, ["build", "--against", "x"], "--against goes with measure"),
        (ngram_prior.main, ["build", "--repeats", "5"], "--repeats goes with measure"),
        (layer_kernels.main, ["--pass", "x", "--model", "0.5B drafter"], "--model goes without --pass"),
        (layer_kernels.main, ["--pass", "x", "--paths"], "--paths goes without --pass"),
        (parse_args, ["--dtype", "float32", "--kernels", "int4"], "--kernels int4: native mode's kernels; --dtype "
                                                                   "float32 runs none"),
        # an empty path was the current folder: --out '' wrote the results there, --prompts '' "Is a directory"
        (parse_args, ["--out", ""], "--out: empty; give a path"),
        (parse_args, ["--prompts", ""], "--prompts: empty; give a path"),
        (turns.main, ["--out", " "], "--out: empty; give a path"),
        # not a multiple of the probe's eight instructions a step: the rates overstated
        (issue_rate.main, ["--iterations", "15"], "argument --iterations: expected a multiple of 8, got '15'"),
        # loaded both models, measured nothing and wrote a results.json marked complete (over the committed one)
        (long_context.main, ["--lengths", "--window-lengths"], "nothing to run: give --lengths"),
        # one-token answers hold no label: "0 positions", then a state_dict TypeError / a ZeroDivisionError
        (train_acceptance_head.parse_args, ["--max-new-tokens", "1"], "expected an integer >= 2, got '1'"),
        (draft_replay.parse_args, ["--train-tokens", "1"], "expected an integer >= 2, got '1'"),
        (draft_replay.parse_args, ["--max-new-tokens", "1"], "expected an integer >= 2, got '1'"),
        # accepted: every replayed rate would have been nan
        (draft_replay.parse_args, ["--round-ms", "nan"], "--round-ms must be a finite number of ms, at least 0"),
        (draft_replay.parse_args, ["--round-ms", "inf"], "--round-ms must be a finite number of ms, at least 0"),
        # "Overflow when unpacking long long" after minutes of collecting
        (train_acceptance_head.parse_args, ["--seed", str(2 ** 64)], "expected an integer from -2**63 to 2**64-1"),
        (train_acceptance_head.parse_args, ["--seed", str(-2 ** 63 - 1)], "expected an integer from -2**63 to 2**64-1"),
        (train_acceptance_head.parse_args, ["--seed", "x"], "expected an integer from -2**63 to 2**64-1"),
    ]
    for parse, argv, message in cases:
        assert message in refused(parse, argv, capsys), (parse.__module__, argv)


def test_a_failing_probe_step_is_one_line():
    # a compiler that failed gave a CalledProcessError traceback
    with pytest.raises(RuntimeError, match=r"^compiling failed \(exit status 1\): no compiler today$"):
        issue_rate.run_step("compiling", [sys.executable, "-c", "import sys; sys.exit('no compiler today')"], 30)
    # a compiler says what is wrong first, then the lines of context and the count of errors
    with pytest.raises(RuntimeError, match=r"^compiling failed \(exit status 1\): probe.c:3: error: no avx2$"):
        issue_rate.run_step("compiling", [sys.executable, "-c", "import sys; sys.stderr.write("
                                          "'probe.c:3: error: no avx2\\n  3 | x\\n1 error generated.\\n'); sys.exit(1)"], 30)
    with pytest.raises(RuntimeError, match="the probe took more than 1 s"):
        issue_rate.run_step("the probe", [sys.executable, "-c", "import time; time.sleep(5)"], 1)


def test_nothing_drafted_is_no_acceptance_rate():
    # long_context and ngram_cache printed 0% for 0 of 0 drafts
    assert cli.acceptance(0, 0) == "–"
    assert cli.acceptance(3, 4) == "75%"


def test_every_tool_is_named_as_it_is_run_and_shows_its_whole_description():
    # five tools' usage read `kernel_ab.py` (a file that cannot run alone); two descriptions stopped mid-sentence
    built = [p.name for p in (ROOT / "benchmarks").glob("*.py")
             if "ArgumentParser(" in p.read_text() and p.name != "cli.py"]
    assert built == [], f"parsers not made by cli.tool_parser: {built}"
    shown = subprocess.run([sys.executable, "-m", "benchmarks.issue_rate", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: python -m benchmarks.issue_rate")
    assert "one core of this machine\nissues a cycle" in shown.stdout
    # the peer took any argument, --help included, and printed only whether llama.cpp imports
    peer = subprocess.run([sys.executable, "-m", "benchmarks.llama_cpp_peer", "--bogus"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert peer.returncode == 2 and "unrecognized arguments: --bogus" in peer.stderr


def test_answers_with_no_label_are_one_line_not_a_traceback(monkeypatch, tmp_path):
    """Answers that all end at their first token (an end token) hold no position: the trainer went on to a
    `load_state_dict(None)` TypeError, the replay to a ZeroDivisionError, both after minutes of collecting."""
    import torch

    empty = (torch.zeros(0, 8), torch.zeros(0), torch.zeros(0))
    monkeypatch.setattr(train_acceptance_head, "collect", lambda args, prompts: {"chat": [empty] * 3})
    with pytest.raises(ValueError, match="no positions to train on: the answers ended at their first token"):
        train_acceptance_head.main(["--out", str(tmp_path / "head.pt")])
    # positions to train on but none to validate on: early stopping has no loss to keep an epoch by
    some = (torch.zeros(3, 8), torch.ones(3), torch.ones(3))
    monkeypatch.setattr(train_acceptance_head, "collect", lambda args, prompts: {"chat": [some, empty, empty]})
    with pytest.raises(ValueError, match="no positions to validate on"):
        train_acceptance_head.main(["--out", str(tmp_path / "head.pt")])
    monkeypatch.setattr(draft_replay, "replay", lambda record, costs, drafts_at: (0.0, 0))
    with pytest.raises(ValueError, match="no answer positions to replay"):
        draft_replay.rate([object()], None, lambda record: None)


def test_no_training_prompt_is_a_held_out_prompt_or_nearly_one():
    """The head's, the replay's and the token ranking's training text must leave the benchmark's prompts out: one
    held-out prompt was also a training prompt, two more nearly so (a stack class with one method fewer)."""
    import difflib

    held_out = [p for prompts in json.loads((ROOT / "benchmarks" / "prompts.json").read_text()).values()
                for p in prompts]
    for name in ("train_prompts.json", "prior_prompts.json"):
        for prompts in json.loads((ROOT / "benchmarks" / name).read_text()).values():
            for prompt in prompts:
                closest = max(difflib.SequenceMatcher(None, prompt, other).ratio() for other in held_out)
                assert closest < 0.8, (name, prompt[:60], closest)


def test_argparse_types_take_their_bounds_and_refuse_what_is_past_them(tmp_path, monkeypatch, capsys):
    # a bound is "at least": the smallest allowed value must run (a gamma of 1, a single sink window), not be refused
    assert cli.at_least(2)("2") == 2 and cli.count_list(2)("2,3") == [2, 3]
    for parse, text in ((cli.at_least(2), "1"), (cli.at_least(2), "x"), (cli.count_list(2), "2,1"),
                        (cli.count_list(1), ","), (cli.choice_list(["a"]), ","), (cli.choice_list(["a"]), "a,b")):
        with pytest.raises(cli.argparse.ArgumentTypeError):
            parse(text)
    # a trailing comma or a space is no value; a name given twice runs once, in the order given
    assert cli.count_list(1)("3, 1,3,") == [3, 1]
    assert cli.choice_list(["a", "b", "c"])("c, a,c,") == ["c", "a"]
    # torch's whole seed range, both ends included (the chat's /seed takes them)
    assert cli.random_seed(str(-2 ** 63)) == -2 ** 63 and cli.random_seed(str(2 ** 64 - 1)) == 2 ** 64 - 1
    # a folder the run cannot write in is refused before the run (root writes anywhere: the check is faked)
    parser = cli.tool_parser("benchmarks.x", "")
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False)
    with pytest.raises(SystemExit):
        cli.writable_folder(parser, "--out", str(tmp_path))
    assert f"--out: cannot write in {tmp_path}" in capsys.readouterr().err
    monkeypatch.undo()
    # an output file's folder is made before the run, as --out folders are
    assert cli.writable_file(parser, "--out", str(tmp_path / "new" / "h.pt")) == tmp_path / "new" / "h.pt"
    assert (tmp_path / "new").is_dir()


def test_guarded_ends_expected_failures_in_one_line_and_lets_others_through(monkeypatch, capsys):
    """A benchmark's expected failures (a model that does not load, an unreadable file, a library's refusal, a
    failed subprocess, Ctrl-C) end in one line naming the command; SPECDEC_TRACEBACK=1 shows the traceback; a bug
    (any other exception) keeps its traceback."""
    import types

    from utils.models.load_error import ModelLoadError

    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=types.SimpleNamespace(
        name="benchmarks.turns")))
    monkeypatch.delenv("SPECDEC_TRACEBACK", raising=False)

    def failing(error):
        def main():
            raise error
        return main

    cases = [(ModelLoadError("no model folder at /x"), "python -m benchmarks.turns: no model folder at /x"),
             (ValueError("bad\nvalue"), "python -m benchmarks.turns: ValueError: bad value"),
             (subprocess.CalledProcessError(1, "cc"), "python -m benchmarks.turns: CalledProcessError: Command 'cc' "
                                                       "returned non-zero exit status 1.")]
    for error, line in cases:
        with pytest.raises(SystemExit) as exit_:
            cli.guarded(failing(error))
        assert exit_.value.code == line
    with pytest.raises(SystemExit) as exit_:
        cli.guarded(failing(KeyboardInterrupt()))
    assert exit_.value.code == 130 and "python -m benchmarks.turns: interrupted" in capsys.readouterr().err
    with pytest.raises(TypeError):
        cli.guarded(failing(TypeError("a bug")))
    monkeypatch.setenv("SPECDEC_TRACEBACK", "1")
    with pytest.raises(ValueError):
        cli.guarded(failing(ValueError("shown whole")))


def test_the_split_is_checked_against_the_smallest_group(tmp_path, capsys):
    # one short group is enough to leave nothing to train on in it
    (tmp_path / "uneven.json").write_text(json.dumps({"chat": ["a", "b"], "code": ["c", "d", "e", "f", "g"]}))
    assert "its smallest group has 2" in refused(
        train_acceptance_head.parse_args, ["--prompts", str(tmp_path / "uneven.json")], capsys)


def positions(n, hidden=4, seed=0):
    """One answer's synthetic examples: features [n, hidden + 4], labels following the top probability, top."""
    import torch

    g = torch.Generator().manual_seed(seed + n)
    top = torch.rand(n, generator=g)
    x = torch.cat([torch.randn(n, hidden, generator=g), top[:, None], top[:, None] / 2, 1 - top[:, None],
                   top[:, None].clamp_min(1e-30).log()], dim=1)
    return x, (top > 0.5).float(), top


def test_training_keeps_the_epoch_of_least_validation_loss_and_is_seeded():
    """Early stopping on the held-back prompts: validation labels opposite to the training ones get worse with every
    step, so the kept head is the first epoch's, and its reported loss is that head's own. A constant feature (its
    std 0) must not turn the standardised features into nan, and the same seed trains the same head."""
    import torch

    x, y, _ = positions(60)
    vx, vy, _ = positions(30, seed=1)
    x[:, 0] = vx[:, 0] = 3.0
    head, val, epoch = train_acceptance_head.train(x, y, vx, 1 - vy, 8, 20, 0, 0.01, True)
    assert epoch == 1
    with torch.no_grad():
        assert val == pytest.approx(torch.nn.functional.binary_cross_entropy_with_logits(head(vx), 1 - vy).item())
        assert torch.isfinite(head(vx)).all()
    assert torch.allclose(head.mean, x.mean(0)) and head.std[0] == pytest.approx(1e-4)  # fitted on training rows
    again, _, _ = train_acceptance_head.train(x, y, vx, 1 - vy, 8, 20, 0, 0.01, True)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))
    # validation labels like the training ones: the loss falls, so a later epoch is kept
    assert train_acceptance_head.train(x, y, vx, vy, 8, 20, 0, 0.01, True)[2] > 1


def test_auc_counts_ties_half_and_the_report_compares_the_head_with_the_top_probability():
    import math

    import torch

    auc = train_acceptance_head.auc
    assert auc(torch.tensor([0.9, 0.5, 0.5, 0.1]), torch.tensor([1.0, 1, 0, 0])) == pytest.approx(3.5 / 4)
    assert math.isnan(auc(torch.tensor([0.3, 0.4]), torch.tensor([1.0, 1.0])))  # one class: no pair to rank
    head = train_acceptance_head.AcceptanceHead(4, width=2)
    with torch.no_grad():
        for p in head.mlp.parameters():
            p.zero_()  # predicts 0.5 everywhere: no better than chance, never "accepted"
    report = train_acceptance_head.evaluate(head, {"a": [positions(30)], "b": [positions(10), positions(20)]})
    assert list(report) == ["a", "b", "all"] and report["all"]["positions"] == 60
    for figures in report.values():  # 57%, 43% and 50% accepted
        accepted = figures["accepted"]
        assert figures["accuracy"] == pytest.approx(1 - accepted, abs=1e-4)
        assert figures["majority_accuracy"] == pytest.approx(max(accepted, 1 - accepted), abs=1e-4)
    assert report["all"]["auc"] == 0.5 and report["all"]["top_probability_auc"] == 1.0  # labels follow top


def test_the_trainer_validates_on_each_groups_last_prompts_and_saves_the_best_grid_point(monkeypatch, tmp_path,
                                                                                           capsys):
    """The last --validation-per-group prompts of each group are held back from training; the grid point of least
    validation loss is saved, its provenance naming the split and whether the hidden state is read."""
    import torch
    from conftest import tiny_decoder

    data = {"chat": [positions(5), positions(6), positions(7)], "code": [positions(3), positions(4), positions(8)]}
    monkeypatch.setattr(train_acceptance_head, "collect", lambda args, prompts: data)
    monkeypatch.setattr(train_acceptance_head, "load_model", lambda *a, **k: (tiny_decoder("llama", seed=1), None))
    train_acceptance_head.main(["--out", str(tmp_path / "head.pt"), "--epochs", "5", "--width", "4"])
    out, err = capsys.readouterr()
    provenance = json.loads(out[:out.rindex("}") + 1])
    assert provenance["train_positions"] == 5 + 3 and provenance["validation_positions"] == 6 + 7 + 4 + 8
    losses = [float(line.rsplit(" ", 1)[1]) for line in err.splitlines() if "validation loss" in line]
    assert len(losses) == 6 and "hidden state in" in err and "hidden state out" in err  # both kinds are tried
    assert provenance["validation_loss"] == pytest.approx(min(losses), abs=1e-4)
    saved = torch.load(tmp_path / "head.pt", weights_only=True)
    assert bool(saved["state"]["mask"][:4].any()) == provenance["hidden_state"]


def test_collected_records_are_reused_only_for_the_same_answer_length(monkeypatch, tmp_path):
    # the cache spares minutes of collecting, but records of 96-token answers must not stand in for 128-token ones
    import torch

    calls = []

    def collect_examples(collector, prompts):
        calls.append(collector)
        return {"chat": [(torch.zeros(1, 5), torch.ones(1), torch.ones(1))]}

    monkeypatch.setattr(train_acceptance_head, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(train_acceptance_head, "collect_examples", collect_examples)
    prompts = str(ROOT / "benchmarks" / "train_prompts.json")
    for tokens in ("96", "96", "128"):
        args = train_acceptance_head.data_args(["--max-new-tokens", tokens])
        args.collector = "collector"
        assert list(train_acceptance_head.collect(args, prompts)) == ["chat"]
    assert len(calls) == 2


def test_the_ngram_cache_benchmark_alternates_loads_saves_and_counts_from_the_second_prompt(tmp_path, monkeypatch,
                                                                                            capsys):
    """The persisted run must load what the previous prompt saved and save what it adds, the fresh run must never
    read the file, the two must take turns, and the first prompt (both start empty there) stays out of the
    figures; an answer that differs on any prompt, not only the last, makes the outputs unequal."""
    from types import SimpleNamespace

    from benchmarks import ngram_cache
    from cli_models import write_tiny_model

    write_tiny_model(tmp_path / "model")
    loaded, events = object(), []

    def nasd_run(ids, storage, *args, **kwargs):
        kind = "loaded" if storage is loaded else "new"
        events.append(("run", kind))
        runs_loaded = events.count(("run", "loaded"))
        tokens = [1, 2, 4] if kind == "loaded" and runs_loaded == 1 else [1, 2, 3]  # the second prompt differs
        return SimpleNamespace(tokens=tokens, drafted=10, accepted=8 if kind == "loaded" else 5)

    def save_storage(path, storage, fingerprint):
        events.append(("save", "loaded" if storage is loaded else "new"))
        path.write_text("saved")

    monkeypatch.setattr(ngram_cache, "nasd_run", nasd_run)
    monkeypatch.setattr(ngram_cache, "save_storage", save_storage)
    monkeypatch.setattr(ngram_cache, "load_storage", lambda *_: events.append(("load",)) or loaded)
    ngram_cache.main(["--target", str(tmp_path / "model"), "--groups", "chat", "--max-new-tokens", "3", "--turns", "0",
                      "--out", str(tmp_path / "out")])
    events = events[1:]  # the warm-up's run
    assert events == [("run", "new"), ("save", "new"), ("run", "new"),  # prompt 1: persisted first, nothing to load
                      ("run", "new"), ("load",), ("run", "loaded"), ("save", "loaded"),  # prompt 2: fresh first
                      ("load",), ("run", "loaded"), ("save", "loaded"), ("run", "new"),
                      ("run", "new"), ("load",), ("run", "loaded"), ("save", "loaded")]
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| chat |"))
    # prompts 2-4: fresh 15 of 30 kept, persisted 24 of 30; counting the first prompt would read 29 of 40
    assert row.startswith("| chat | 2-4 | 50% | 80% | 30 / 30 |") and row.endswith("| False |")
    assert (tmp_path / "out" / "ngram-cache.md").read_text().count("| chat | 2-4 |") == 1
    # a group of one prompt has no figures (its only prompt is the first): a dash, not a rate of nothing
    assert (ngram_cache.median([]), ngram_cache.median([3.0, 1.0, 2.0])) == ("–", "2.0")


def test_the_ngram_cache_conversation_runs_every_turn_and_persists_through_both_sessions(tmp_path, monkeypatch,
                                                                                        capsys):
    from benchmarks import ngram_cache
    from cli_models import write_tiny_model
    from utils.chat.session import Session

    write_tiny_model(tmp_path / "model")
    files, use = [], Session.use_ngram_cache
    monkeypatch.setattr(Session, "use_ngram_cache", lambda self, path: files.append(path) or use(self, path))
    ngram_cache.main(["--target", str(tmp_path / "model"), "--groups", "chat", "--max-new-tokens", "2", "--turns", "2",
                      "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    for number in (1, 2):
        assert [f"session {number} turn {t}:" in out for t in (1, 2, 3)] == [True, True, False]
    # the second session reads the file the first one saved: the case a persisted cache is for
    assert len(files) == 2 and files[0] == files[1] and files[0].endswith("conversation.ngram")
    assert "| 2 (the same questions again) |" in out
