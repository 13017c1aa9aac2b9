"""The benchmark's command line: narrowing it to prompt groups and methods, and refusing unknown groups early
(before minutes of model loading)."""

import subprocess
from types import SimpleNamespace

import pytest
import torch

from benchmarks import cli, draft_stop_ab, llama_cpp_peer, run
from benchmarks.run import method_names, parse_args
from sampling import draft_cap
from utils.chat.settings import parse_processor


def test_groups_default_to_all_and_can_be_narrowed():
    assert parse_args([]).groups == ["code-writing", "code-editing", "chat"]
    assert parse_args(["--groups", "chat,code-editing"]).groups == ["code-editing", "chat"]  # the file's order


def test_unknown_group_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--groups", "poems"])
    assert exit_.value.code == 2
    assert "unknown poems; known: code-writing, code-editing, chat" in capsys.readouterr().err


def test_quick_is_short():
    args = parse_args(["--quick"])
    assert (args.prompts_per_group, args.gammas, args.repeats, args.cache_off_prompts) == (1, [2, 4, 8], 1, 0)
    args = parse_args(["--quick", "--gammas", "3", "--repeats", "2"])  # it fills only what is not given
    assert (args.prompts_per_group, args.gammas, args.repeats, args.cache_off_prompts) == (1, [3], 2, 0)
    args = parse_args([])
    assert (args.prompts_per_group, args.gammas, args.repeats, args.cache_off_prompts) == (4, list(range(1, 9)), 3, 1)


def test_a_prompt_file_that_is_no_prompt_file_is_one_line(tmp_path, capsys):
    for name, data in (("binary.json", b"\xff\xfe\x00x"), ("list.json", b'["a", "b"]'), ("text.json", b"hello")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--prompts", str(tmp_path / name)])
        assert exit_.value.code == 2 and f"--prompts: {tmp_path / name}: " in capsys.readouterr().err


def test_llama_cpp_methods_leave_the_defaults_for_a_target_that_is_no_gguf(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    args = parse_args(["--target", str(tmp_path / "m")])
    assert not set(args.methods) & set(llama_cpp_peer.METHODS) and args.methods_asked == []
    assert parse_args(["--methods", "ours-ar"]).methods_asked == ["ours-ar"]
    if llama_cpp_peer.available():
        with pytest.raises(SystemExit):
            parse_args(["--target", str(tmp_path / "m"), "--methods", "llama-plain,ours-ar"])
        assert "llama-plain run llama.cpp on the target's GGUF file" in capsys.readouterr().err


def test_every_benchmark_refuses_bad_counts_and_a_missing_model_in_one_line(tmp_path):
    """They ended in tracebacks (a negative prefill segfaulted in llama.cpp; a missing model raised
    ModelLoadError through `main`)."""
    import subprocess
    import sys

    from test_cli import ROOT

    def run(*argv):
        done = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in done.stderr, done.stderr[-1500:]
        return done.returncode, done.stderr.strip().splitlines()[-1]

    assert run("benchmarks.prefill", "--tokens", "-1") == (
        2, "python -m benchmarks.prefill: error: argument --tokens: expected an integer >= 1, got '-1'")
    assert run("benchmarks.turns", "--turns", "99")[1].endswith("--turns: at most 8 (the follow-ups this benchmark has)")
    assert run("benchmarks.layer_kernels", "--widths", "1,x")[0] == 2
    assert run("benchmarks.native_vs_f32", "--target", str(tmp_path / "none")) == (
        1, f"python -m benchmarks.native_vs_f32: no model folder at {tmp_path / 'none'}")
    assert run("benchmarks.token_rank", "--drafter", str(tmp_path / "none"))[0] == 1
    helped = subprocess.run([sys.executable, "-m", "benchmarks.run", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "--max-new-tokens" in helped.stdout  # it printed nothing


def test_methods_default_to_all_and_are_narrowed_in_table_order():
    args = parse_args(["--gammas", "2,8"])
    assert args.methods[:3] == ["ours-ar", "ours-sd-g2", "ours-sd-g8"]
    assert "hf-assisted-cheap" in args.methods
    assert len(args.methods) == 16 + (len(llama_cpp_peer.METHODS) if llama_cpp_peer.available() else 0)
    assert parse_args(["--methods", "hf-generate,ours-ar"]).methods == ["ours-ar", "hf-generate"]


def test_draft_stop_methods_one_per_entropy_bound():
    args = parse_args(["--entropy-bounds", "0.3,0.6", "--methods", "ours-sd-entropy-0.3,ours-sd-entropy-0.6,ours-sd-learned",
                       "--gammas", "2,5"])
    assert args.methods == ["ours-sd-entropy-0.3", "ours-sd-entropy-0.6", "ours-sd-learned"]
    assert args.stop_gamma == 5


def test_stop_gamma_auto_gives_each_rule_the_chats_cap(monkeypatch, capsys):
    """auto: what /gamma auto gives each rule in the chat, the cap timed here for greedy confidence >= 0.9 only
    (timed once, and not at all where no rule takes it), FALLBACK_CAP (6) for the others; a number for every rule."""
    assert parse_args(["--stop-gamma", "AUTO"]).stop_gamma == "auto"
    assert parse_args(["--stop-gamma", "3"]).stop_gamma == 3
    with pytest.raises(SystemExit):
        parse_args(["--stop-gamma", "0"])
    assert "argument --stop-gamma: expected an integer >= 1 or auto, got '0'" in capsys.readouterr().err
    costs = draft_cap.PassTimes(0.01, {w: 0.04 for w in range(3, 14)})
    timings = []
    monkeypatch.setattr(draft_cap, "load_or_measure",
                        lambda target, drafter, note=None: timings.append(1) or (draft_cap.best_cap(costs), costs))
    methods = ["ours-ar", "ours-sd-g3", "ours-sd-confident", "ours-sd-entropy-0.5", "ours-sd-learned"]

    def caps(processor: str, confidence: float, asked):
        bench = SimpleNamespace(args=SimpleNamespace(methods=methods, confidence=confidence),
                                processor=parse_processor(processor.split()), target=None, drafter=None)
        return run.Bench.caps_for(bench, asked)

    assert caps("greedy", 0.9, "auto") == {"ours-sd-confident": 12, "ours-sd-entropy-0.5": 6, "ours-sd-learned": 6}
    assert len(timings) == 1 and "ours-sd-confident at most 12 drafts (drafter step 10.0 ms" in capsys.readouterr().out
    for processor, confidence in (("nucleus 0.7 0.9", 0.9), ("greedy", 0.5)):  # the chat's untimed cases
        assert set(caps(processor, confidence, "auto").values()) == {draft_cap.FALLBACK_CAP}
    assert len(timings) == 1
    assert caps("greedy", 0.9, 4) == {"ours-sd-confident": 4, "ours-sd-entropy-0.5": 4, "ours-sd-learned": 4}
    assert run.describe_caps({"ours-sd-confident": 12, "ours-sd-entropy-0.5": 6, "ours-sd-learned": 6}) == (
        "confident at most 12 drafts a round, entropy-0.5/learned at most 6")
    meta = dict(machine="m", target="t", drafter="d", dtype="x", max_new_tokens=8, cache_off_tokens=4,
                prompts_per_group=1, repeats=1)
    assert "repeat(s); confident at most 12 drafts a round.\n" in run.markdown([], {**meta, "stop_caps": {
        "ours-sd-confident": 12}})
    assert "repeat(s).\n" in run.markdown([], {**meta, "stop_caps": {}})  # no draft-stop method ran


def test_draft_stop_methods_run_at_their_caps(monkeypatch):
    """ours-sd-confident and the rule methods draft up to their own cap (it had followed the largest of --gammas)."""
    seen = {}

    def speculative_run(ids, drafter, target, processor, loop, cache, **kwargs):
        seen[kwargs.get("confidence") or kwargs["draft_stop"]] = loop.gamma

    monkeypatch.setattr(run, "speculative_run", speculative_run)
    bench = SimpleNamespace(args=SimpleNamespace(gammas=[1, 8], confidence=0.9), processor=None, stop=[0],
                            drafter=None, target=None, stop_rules={"ours-sd-learned": "rule"},
                            stop_caps={"ours-sd-confident": 12, "ours-sd-learned": 6}, translated=None)
    for method in ("ours-sd-confident", "ours-sd-learned"):
        run.Bench.ours(bench, method, [1], True, 4)
    assert seen == {0.9: 12, "rule": 6}


def test_repeats_run_in_turns_each_from_its_own_seed():
    """A prompt's methods take turns (every other repeat reversed); repeat i of each samples from seed i, so that
    sampled repeats weigh several answers instead of timing one answer again."""
    calls = []

    def once(method, ids, cache, n, seed=0):
        calls.append((method, n, seed))
        return [1, 2], 0.5, None, None

    bench = SimpleNamespace(args=SimpleNamespace(repeats=3), processor=parse_processor(["nucleus", "0.7", "0.9"]),
                            once=once)
    runs = run.Bench.prompt_runs(bench, "chat", 0, [7], True, 2, ["a", "b"], SimpleNamespace(update=lambda: None))
    timed = [(method, seed) for method, n, seed in calls if n == 2]  # the 3-token warm-ups aside
    assert timed == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert [(r.method, r.tokens_per_s) for r in runs] == [("a", 4.0), ("b", 4.0)]


def test_sampling_compares_our_methods_only(capsys):
    args = parse_args(["--processor", "nucleus 0.7 0.9", "--methods", "ours-ar,ours-sd-g3", "--gammas", "3"])
    assert not args.processor_obj.is_greedy
    with pytest.raises(SystemExit):
        parse_args(["--processor", "nucleus 0.7 0.9", "--methods", "ours-ar,hf-generate"])
    assert "sampling compares our methods only" in capsys.readouterr().err


def test_crossed_drafter_methods_need_the_cheap_drafter():
    methods = parse_args(["--no-cheap-drafter"]).methods
    assert "ours-sd-full" not in methods and "hf-assisted-cheap" not in methods and "hf-assisted" in methods


def test_llama_cpp_methods_only_where_llama_cpp_python_is_installed():
    assert method_names([4], True, llama=False)[-1] == "hf-prompt-lookup"
    assert method_names([4], True, llama=True)[-3:] == ["llama-plain", "llama-lookup", "llama-sd"]


@pytest.mark.parametrize("argv, message", [
    (["--methods", "ours-ar,ours-magic"], "--methods: unknown ours-magic; known: ours-ar, ours-sd-g1"),
    (["--gammas", "2", "--methods", "ours-sd-g8"], "--methods: unknown ours-sd-g8; known: ours-ar, ours-sd-g2,"),
    (["--no-cheap-drafter", "--methods", "ours-sd-full"], "--methods: unknown ours-sd-full"),
    (["--gammas", "2,four"], "argument --gammas: expected comma-separated integers >= 1, got '2,four'"),
    (["--gammas", "0,4"], "argument --gammas: expected comma-separated integers >= 1, got '0,4'"),
    (["--entropy-bounds", "half"], "argument --entropy-bounds: expected a number, got 'half'"),
    (["--entropy-bounds", ","], "argument --entropy-bounds: expected comma-separated numbers, got ','"),
    (["--entropy-bounds", "5"], "argument --entropy-bounds: the entropy bound must be in [0, 1), got 5.0"),  # was after loading
    (["--entropy-bounds", "-1", "--methods", "ours-ar"], "the entropy bound must be in [0, 1), got -1.0"),  # was accepted
    (["--processor", "beam 3"], "--processor: processor must be one of"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1, got '0'"),  # was ZeroDivisionError
    (["--repeats", "0"], "argument --repeats: expected an integer >= 1"),  # was KeyError: 'ours-ar'
    (["--prompts-per-group", "0"], "argument --prompts-per-group: expected an integer >= 1"),  # was an empty table
    (["--cache-off-tokens", "-5"], "argument --cache-off-tokens: expected an integer >= 1"),
    (["--quick", "--gammas", "-2"], "argument --gammas: expected comma-separated integers >= 1, got '-2'"),  # --quick overrode it
    (["--confidence", "2"], "argument --confidence: confidence must be in [0, 1), got 2.0"),  # was after loading
    (["--confidence", "1"], "argument --confidence: confidence must be in [0, 1), got 1.0"),  # was after loading
    (["--prompts", "/no/prompts.json"], "--prompts: cannot read /no/prompts.json: No such file or directory"),
    (["--target", "/no/such/model"], "--target: no model folder at /no/such/model"),
    (["--out", "/proc/no/results"], "--out: cannot make /proc/no/results"),  # was after the whole run
])
def test_bad_methods_and_gammas_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_draft_stop_ab_alternates_the_order_and_refuses_bad_counts_early(capsys):
    args = draft_stop_ab.parse_args([])
    assert (args.repeats, args.max_new_tokens, args.stop_gamma, args.entropy_bound) == (2, 128, [6], 0.5)
    assert (args.gammas, args.confidences, args.use_cache, args.prompts) == ([1, 2, 3, 5], [], True,
                                                                           str(draft_stop_ab.PROMPTS))
    assert list(args.groups) == ["code-writing", "code-editing", "chat"]
    args = draft_stop_ab.parse_args(["--gammas", "2,3", "--confidences", "0.4,0.9", "--no-cache",
                                     "--stop-gamma", "6,10"])
    assert (args.gammas, args.confidences, args.use_cache, args.stop_gamma) == ([2, 3], [0.4, 0.9], False, [6, 10])
    assert args.processor.is_greedy  # greedy unless --processor: every output then equal
    assert not draft_stop_ab.parse_args(["--processor", "nucleus 0.7 0.9"]).processor.is_greedy
    # sampled repeats draw anew from --seed on (seed + repeat), so a second run can take other answers
    assert (args.seed, draft_stop_ab.parse_args(["--seed", "4"]).seed) == (0, 4)
    # auto: the chat's /gamma auto, timed once the models are loaded
    assert draft_stop_ab.parse_args(["--stop-gamma", "6, AUTO,6"]).stop_gamma == [6, "auto"]
    assert draft_stop_ab.parse_args(["--stop-gamma", "auto"]).stop_gamma == ["auto"]
    methods = ["ar", "g1", "learned"]
    assert cli.in_turn(methods, 0) == methods and cli.in_turn(methods, 1) == methods[::-1]
    # the issue's report: a rule's mean length and acceptance beside its tokens/s; a group without rounds reads 0
    assert draft_stop_ab.drafts_and_acceptance(10, 35, 28) == "3.5 drafts a round, 80% accepted"
    assert draft_stop_ab.drafts_and_acceptance(0, 0, 0) == "0.0 drafts a round, 0% accepted"
    for argv, message in ((["--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
                          (["--stop-gamma", "-1"],
                           "argument --stop-gamma: expected comma-separated integers >= 1 or auto, got '-1'"),
                          (["--stop-gamma", "auto,0"],
                           "argument --stop-gamma: expected comma-separated integers >= 1 or auto, got 'auto,0'"),
                          (["--processor", "nucleus 7"], "--processor: usage: nucleus T P"),
                          (["--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
                          (["--stop-gamma", "auto", "--no-cache"],
                           "--stop-gamma auto is the cap timed with the cache on"),
                          (["--entropy-bound", "1.5"], "argument --entropy-bound: the entropy bound must be in [0, 1)"),
                          (["--gammas", "0,2"], "argument --gammas: expected comma-separated integers >= 1, got '0,2'"),
                          (["--gammas", "two"], "argument --gammas: expected comma-separated integers >= 1, got 'two'"),
                          (["--confidences", "high"], "argument --confidences: expected a number, got 'high'"),
                          (["--confidences", "1.2"], "argument --confidences: confidence must be in [0, 1)"),
                          (["--prompts", "/no/prompts.json"],
                           "--prompts: cannot read /no/prompts.json: No such file or directory")):
        with pytest.raises(SystemExit) as exit_:
            draft_stop_ab.parse_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_kernel_ab_refuses_bad_counts_before_building(capsys):
    from benchmarks import kernel_ab

    args = kernel_ab.parse_args(["--base", "HEAD", "--rows", "1,8", "--repeats", "3"])
    assert (args.rows, args.widths, args.repeats) == ([1, 8], [1, 4, 9, 60], 3)
    for bad in (["--rows", "0,4"], ["--widths", "four"], ["--repeats", "0"], []):
        with pytest.raises(SystemExit) as exit_:
            kernel_ab.parse_args((["--base", "HEAD"] if bad else []) + bad)
        assert exit_.value.code == 2
    assert "argument --rows: expected comma-separated integers >= 1, got '0,4'" in capsys.readouterr().err


def test_kernel_ab_takes_a_revisions_sources_under_another_namespace(tmp_path):
    from benchmarks import kernel_ab

    sources = kernel_ab.base_sources("HEAD", tmp_path)
    listed = subprocess.run(["git", "-C", str(kernel_ab.KERNELS), "ls-tree", "--name-only", "HEAD", "."],
                            capture_output=True, text=True, check=True).stdout.split()
    assert [s.name for s in sources] == sorted(n for n in listed if n.endswith(".cpp"))  # HEAD's, not this tree's
    assert {"qkernels.cpp", "matmul.cpp"} <= {s.name for s in sources}
    ops = (tmp_path / "qkernels.cpp").read_text()
    assert "TORCH_LIBRARY(specdec_base," in ops and "TORCH_LIBRARY_IMPL(specdec_base," in ops
    assert "TORCH_LIBRARY(specdec," not in ops
    assert (tmp_path / "interleaved.h").is_file()
    with pytest.raises(SystemExit, match="no kernel sources at revision"):
        kernel_ab.base_sources("no-such-revision", tmp_path)


def test_issue_rate_probes_run_and_refuse_bad_counts(capsys):
    """The instruction-rate probe compiles and prints one row a turn with a rate for each probe (a rate is not
    checked against a bound: a VM's share of a core varies; RESULTS.md reads the best turns)."""
    from benchmarks import issue_rate

    with pytest.raises(SystemExit) as exit_:
        issue_rate.main(["--repeats", "0"])
    assert exit_.value.code == 2 and "argument --repeats: expected an integer >= 1" in capsys.readouterr().err
    why = issue_rate.supported()
    if why:
        pytest.skip(why)
    rows = issue_rate.measure(iterations=80_000, repeats=2)
    assert [r["turn"] for r in rows] == [0, 1]
    assert all(r["clock"] > 0 and all(r[name] > 0 for name in issue_rate.PROBES) for r in rows)
    issue_rate.main(["--repeats", "1", "--iterations", "8000"])
    out = capsys.readouterr().out
    assert "maddubs + paddw pairs a cycle" in out and "| best |" in out


def test_issue_rate_refuses_a_cpu_without_fma(monkeypatch):
    import platform

    from benchmarks import issue_rate
    from utils.models import kernel_choice

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernel_choice, "cpu_facts", lambda: {"cpu": "old", "flags": ["avx2"]})
    assert issue_rate.supported() == "this CPU lists no FMA in /proc/cpuinfo"
    monkeypatch.setattr(kernel_choice, "cpu_facts", lambda: {"cpu": "older", "flags": []})
    assert issue_rate.supported() == "this CPU lists no AVX2 or FMA in /proc/cpuinfo"


def test_contenders_take_turns_in_alternating_order():
    """Timed in turns, the contenders swap order every other turn (the product's kernel choice and the
    benchmarks alike): on a host whose speed drifts, the one always going first would be favoured or not."""
    from benchmarks.layer_kernels import interleaved
    from utils.models import kernel_choice
    from utils.models.kernel_choice import WARMUP

    order = []
    samples = interleaved(["a", "b"], order.append, repeats=4)
    assert order == ["a", "b", "b", "a"] * ((WARMUP + 4) // 2) + (["a", "b"] if (WARMUP + 4) % 2 else [])
    assert {name: len(times) for name, times in samples.items()} == {"a": 4, "b": 4}
    order.clear()
    medians = kernel_choice.time_in_turns({"x": lambda: order.append("x"), "y": lambda: order.append("y")})
    rounds = kernel_choice.WARMUP + kernel_choice.REPEATS
    assert order == [name for r in range(rounds) for name in (("x", "y") if r % 2 == 0 else ("y", "x"))]
    assert set(medians) == {"x", "y"}


def test_no_timed_call_of_our_kernels_quantises_wherever_it_falls_in_a_turn():
    """The kernel choice's timed calls: an even number of turns (each contender goes first as often as second), and
    every kernel of a shape gets the same input at a width, so our kernels' activation cache (`quantise_shared`)
    serves each of their calls after the first, whichever kernel ran before it."""
    import torch

    from utils.models import kernel_choice, qkernels
    from utils.models.model_loader import cache_root
    from utils.models.native_linear import quantise_shared

    assert kernel_choice.REPEATS % 2 == 0 and kernel_choice.WARMUP % 2 == 0
    assert qkernels.ensure(cache_root()), qkernels.why()
    x = torch.randn(3, 32)
    made = []
    ours = [lambda x: made.append(quantise_shared(x, "Q4_0")), lambda x: made.append(quantise_shared(x, "Q4_0"))]
    theirs = [lambda x: made.append(None)]  # a torch kernel: no activation blocks
    kernel_choice.samples_in_turns({"a": kernel_choice.cycling(ours, x), "b": kernel_choice.cycling(ours, x),
                                    "int4": kernel_choice.cycling(theirs, x)}, repeats=4)
    blocks = [b for b in made if b is not None]
    assert len(made) == 3 * (kernel_choice.WARMUP + 4) and len(blocks) == 2 * (kernel_choice.WARMUP + 4)
    assert all(b is blocks[0] for b in blocks)  # quantised once, by the first call


def test_kernel_ab_reports_each_turns_ratio(capsys):
    from benchmarks import kernel_ab

    kernel_ab.report("Q4_K 8 x 256, 4 rows", ({"base": 2e-3, "this tree": 1e-3}, [0.4, 0.5, 0.7]))
    assert "base 2.000 ms, this tree 1.000 ms (0.500x; turns 0.400-0.700x)" in capsys.readouterr().out


def test_llama_methods_without_llama_cpp_say_why(monkeypatch, capsys):
    # llama-cpp-python installed without its dependencies: the methods are named with the import error, not unknown
    real_import = __import__

    def failing_import(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ModuleNotFoundError("No module named 'diskcache'", name="diskcache")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", failing_import)
    assert llama_cpp_peer.unavailable() == "llama-cpp-python does not import (No module named 'diskcache')"
    with pytest.raises(SystemExit):
        parse_args(["--methods", "ours-ar,llama-plain"])
    assert "llama-plain need llama.cpp: llama-cpp-python does not import" in capsys.readouterr().err

    def absent_import(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ModuleNotFoundError("No module named 'llama_cpp'", name="llama_cpp")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", absent_import)
    assert "not installed" in llama_cpp_peer.unavailable()


def test_a_method_that_cannot_run_is_refused_where_asked_and_left_out_where_defaulted(capsys):
    from benchmarks.run import Bench

    bench = Bench.__new__(Bench)
    bench.args = parse_args([])
    assert bench.args.methods_asked == [] and "ours-sd-learned" in bench.args.methods
    bench.cannot_run("ours-sd-learned", "trained for another drafter")
    assert "ours-sd-learned" not in bench.args.methods
    assert "ours-sd-learned left out: trained for another drafter" in capsys.readouterr().err
    bench.args = parse_args(["--methods", "ours-ar,ours-sd-learned"])
    with pytest.raises(SystemExit, match="ours-sd-learned: trained for another drafter"):
        bench.cannot_run("ours-sd-learned", "trained for another drafter")


def test_entropy_bounds_close_together_are_two_methods_each_run_at_its_own_bound():
    """A sweep found `{b:g}` names (six digits): 0.1234567 and 0.1234568 became one name run twice, at neither bound,
    and the name a user wrote from their own bound was refused."""
    args = parse_args(["--entropy-bounds", "0.1234567,0.1234568", "--methods",
                       "ours-sd-entropy-0.1234567,ours-sd-entropy-0.1234568", "--gammas", "2"])
    assert args.methods == ["ours-sd-entropy-0.1234567", "ours-sd-entropy-0.1234568"]
    assert [run.draft_stop_of(m).entropy_bound for m in args.methods] == [0.1234567, 0.1234568]
    args = parse_args(["--entropy-bounds", "0.00001", "--methods", "ours-sd-entropy-0.00001"])  # written either way
    assert args.methods == ["ours-sd-entropy-1e-05"] and run.draft_stop_of(args.methods[0]).entropy_bound == 1e-05


@pytest.mark.parametrize("flag, value", [("--methods", "ours-ar,"), ("--methods", " ours-ar"), ("--groups", "chat,")])
def test_a_trailing_comma_or_a_space_in_a_list_is_not_an_unknown_name(flag, value):
    """A sweep found `--methods ours-ar,` refused as 'unknown ;' and ' ours-ar' as unknown while listed as known."""
    args = parse_args([flag, value])
    assert (args.methods if flag == "--methods" else args.groups) == [value.strip(" ,")]


def test_an_empty_list_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--methods", ","])
    assert exit_.value.code == 2 and "--methods: no name in ','" in capsys.readouterr().err


def test_draft_vocab_with_no_cheap_drafter_is_refused_not_ignored(capsys):
    """The vocabulary narrows the cheap copy's head only: with that copy off it was accepted and never used."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--draft-vocab", "5", "--no-cheap-drafter", "--methods", "ours-ar"])
    assert exit_.value.code == 2 and "--draft-vocab: applies to the cheap drafter" in capsys.readouterr().err
    assert parse_args(["--no-cheap-drafter", "--methods", "ours-ar"]).draft_vocab == run.DEFAULT_DRAFT_VOCAB
    assert parse_args(["--draft-vocab", "0"]).draft_vocab == 0


def test_draft_stop_ab_runs_two_close_thresholds_as_two_rules():
    """Named with `{p:g}` (six digits), 0.1234567 and 0.1234568 were one rule: the second overwrote the first."""
    configs = draft_stop_ab.rule_configs(draft_stop_ab.parse_args(["--confidences", "0.1234567,0.1234568,0.9"]))
    assert [name for name in configs if name.startswith("confidence")] == [
        "confidence 0.1234567", "confidence 0.1234568", "confidence 0.9"]
    assert configs["confidence 0.1234567"].confidence == 0.1234567


def counted(method, prompt, tokens, forwards, drafted=None, accepted=None, rounds=None):
    return run.Run(method, "code", prompt, True, tokens, 10.0, forwards, None, drafted, accepted, rounds)


def test_the_summary_divides_sums_not_averages_per_prompt_ratios():
    # a prompt that accepts all 56 drafts and one that accepts 32 of 256 read 56% (the mean of 100% and 12.5%)
    # where 88 of 312 drafts were kept; tokens a target pass were a harmonic mean of the prompts' figures
    runs = [counted("ours-sd-g8", 0, 64, 8, 56, 56, 8), counted("ours-sd-g8", 1, 8, 4, 256, 32, 32)]
    row, = run.summarise(runs)
    assert row["acceptance_rate"] == pytest.approx(88 / 312)
    assert row["drafts_per_round"] == pytest.approx(312 / 40)
    assert row["tokens_per_target_forward"] == pytest.approx(72 / 12)
    assert row["target_forwards_per_token"] == pytest.approx(12 / 72)
    nothing, = run.summarise([counted("ours-nasd", 0, 8, 8, 0, 0, 8)])
    assert nothing["acceptance_rate"] is None and nothing["drafts_per_round"] == 0


def test_a_prompts_figures_count_every_repeat_not_the_last():
    """Sampled, each repeat answers differently: acceptance and passes came from the last repeat alone, beside a
    tokens/s over all of them (10% shown where the three repeats kept 62% of their drafts)."""
    from sampling.loop import GenerationResult

    kept = {0: 36, 1: 34, 2: 4}

    def once(method, ids, cache, n, seed=0):
        if method == "ours-ar":
            return [1, 2], 0.5, GenerationResult([1, 2], target_calls=3), None
        return [1, 2, 3], 0.5, GenerationResult([1, 2, 3], drafted=40, accepted=kept[seed], target_calls=10,
                                                rounds=10), None

    bench = SimpleNamespace(args=SimpleNamespace(repeats=3), processor=parse_processor(["nucleus", "0.7", "0.9"]),
                            once=once)
    ar, sd = run.Bench.prompt_runs(bench, "chat", 0, [7], True, 3, ["ours-ar", "ours-sd-g4"],
                                   SimpleNamespace(update=lambda: None))
    assert (sd.drafted, sd.accepted, sd.rounds, sd.target_forwards, sd.tokens) == (120, 74, 30, 30, 9)
    assert sd.acceptance_rate == pytest.approx(74 / 120) and sd.same_as_ar is None  # sampled: no reference
    assert (ar.target_forwards, ar.drafted, ar.acceptance_rate) == (9, None, None)


def test_greedy_output_is_ars_only_if_every_repeat_is():
    answers = {"ours-ar": [([1, 2], None), ([1, 2], None)], "ours-nasd": [([1, 2], None), ([1, 3], None)],
               "hf-generate": [([1, 2], None), ([1, 2], None)], "llama-plain": [([5], None), ([5], None)]}
    same = {m: run.prompt_run(m, "chat", 0, True, 1.0, answers, greedy=True).same_as_ar for m in answers}
    assert same == {"ours-ar": None, "ours-nasd": False, "hf-generate": True, "llama-plain": None}


def test_the_table_says_how_many_prompts_ran_not_how_many_were_asked():
    # --prompts-per-group 8 on a file of 4 a group said "8 prompt(s) per group"
    runs = [run.Run("ours-ar", g, i, True, 4, 1.0, 4, None) for g, n in (("code", 4), ("chat", 2)) for i in range(n)]
    assert run.prompts_run(runs, True) == {"code": 4, "chat": 2} and run.prompts_run(runs, False) == 0
    assert run.prompts_run(runs[:4], True) == 4
    meta = {"machine": "m", "target": "t", "drafter": "d", "dtype": "x", "max_new_tokens": 8, "cache_off_tokens": 4,
            "prompts_per_group": {"code": 4, "chat": 2}, "repeats": 1}
    assert "code 4, chat 2 prompt(s) per group" in run.markdown([], meta)


def test_the_plot_is_titled_with_the_runs_processor(tmp_path):
    import matplotlib.pyplot as plt

    rows = [{"cache": True, "group": "chat", "method": "ours-sd-g2", "speedup_vs_ours_ar": 1.2}]
    run.plot(rows, [2], tmp_path / "speedup.png", "nucleus 0.7 0.9")
    assert plt.gcf().axes[0].get_title() == "Nucleus 0.7 0.9, cache on"  # it read "Greedy" for sampled runs
    plt.close("all")


class FakeLlama:
    """llama_cpp.Llama as LlamaPeer uses it, without llama-cpp-python (CI has none): it keeps what it was built and
    asked with, calls its draft model once a generation, and answers 5, 6, 7, logging each token as it yields it."""

    def __init__(self, model_path, draft_model=None, **kwargs):
        self.model_path, self.draft_model, self.kwargs, self.resets = model_path, draft_model, kwargs, 0
        self.asked, self.log = [], []

    def reset(self):
        self.resets += 1

    def generate(self, ids, **kwargs):
        self.asked.append(kwargs)
        if self.draft_model is not None:
            self.draft_model(ids)
        for token in (5, 6, 7):
            self.log.append(token)
            yield token


class FakeLookup:
    def __init__(self, num_pred_tokens):
        self.num_pred_tokens = num_pred_tokens

    def __call__(self, input_ids, **_):
        return [input_ids[-1]]


def fake_llama_cpp(monkeypatch):
    """llama_cpp and llama_cpp.llama_speculative replaced by the fakes above."""
    import sys
    import types

    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaDraftModel = object
    speculative.LlamaPromptLookupDecoding = FakeLookup
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)


def test_llama_sd_pays_its_drafters_prefill_in_every_run(monkeypatch, tmp_path):
    """The drafter's own llama.cpp context kept the prompt from the warm-up: each timed llama-sd run fed its
    drafter 9 tokens instead of the prompt's 51, while ours pay both prefills."""
    fake_llama_cpp(monkeypatch)
    peer = llama_cpp_peer.LlamaPeer(tmp_path / "t.gguf", tmp_path / "d.gguf")
    for _ in range(2):
        assert peer.generate("llama-sd", [1, 2, 3], 2, stop=[]) == [5, 6]
    target = peer.models["llama-sd"]
    assert (target.resets, target.draft_model.llm.resets) == (2, 2)
    assert peer.generate("llama-plain", [1], 1, stop=[]) == [5]  # a method without a drafter
    assert target.draft_model.proposed == llama_cpp_peer.SD_DRAFTS  # the last run's: 3 of the fake's 3 tokens
    assert target.draft_model.drafted == 1  # counted: 2 tokens asked, the round's own token fills the second
    fewer = llama_cpp_peer.LlamaPeer(tmp_path / "t.gguf", tmp_path / "d.gguf", sd_drafts=2)
    fewer.generate("llama-sd", [1, 2, 3], 2, stop=[])
    assert fewer.models["llama-sd"].draft_model.proposed == 2  # --llama-sd-drafts reaches the drafter


def test_llama_sd_drafts_is_a_count_of_at_least_one(capsys):
    assert parse_args([]).llama_sd_drafts == llama_cpp_peer.SD_DRAFTS
    assert parse_args(["--llama-sd-drafts", "5"]).llama_sd_drafts == 5
    with pytest.raises(SystemExit):
        parse_args(["--llama-sd-drafts", "0"])
    assert "--llama-sd-drafts" in capsys.readouterr().err


def test_llama_cpp_peers_decode_greedily_on_their_own_files_with_every_thread(monkeypatch, tmp_path):
    """The peers stand beside ours only if they run what ours run: greedy decoding (target and llama-sd's drafter:
    a sampled draft is rejected more often and makes llama-sd look slow), the drafter's own GGUF file (the target
    drafting for itself accepts everything), every thread for the prompt's batch as for decoding, and the
    documented number of lookup drafts."""
    fake_llama_cpp(monkeypatch)
    peer = llama_cpp_peer.LlamaPeer(tmp_path / "t.gguf", tmp_path / "d.gguf", context=256)
    for method in llama_cpp_peer.METHODS:
        peer.generate(method, [1, 2, 3], 2, stop=[])
        llm = peer.models[method]
        assert llm.model_path == str(tmp_path / "t.gguf") and llm.kwargs["n_ctx"] == 256
        assert llm.kwargs["n_threads"] == llm.kwargs["n_threads_batch"] == peer.threads
        assert (llm.asked[-1]["top_k"], llm.asked[-1]["temp"]) == (1, 0.0)
    drafter = peer.models["llama-sd"].draft_model.llm
    assert drafter.model_path == str(tmp_path / "d.gguf")
    assert drafter.kwargs["n_threads"] == drafter.kwargs["n_threads_batch"] == peer.threads
    assert all((asked["top_k"], asked["temp"]) == (1, 0.0) for asked in drafter.asked) and drafter.asked
    assert peer.models["llama-lookup"].draft_model.num_pred_tokens == llama_cpp_peer.LOOKUP_TOKENS
    # no drafter file: no llama-sd, rather than a llama-sd drafting with the target
    assert "llama-sd" not in llama_cpp_peer.LlamaPeer(tmp_path / "t.gguf").models


def test_llama_cpp_answers_end_at_a_stop_token_kept_or_at_the_length(monkeypatch, tmp_path):
    """As our generators do: a stop token ends the answer and counts in it, else `n` tokens; an answer that ran on
    past its end would be timed and compared over tokens ours never produce."""
    fake_llama_cpp(monkeypatch)
    peer = llama_cpp_peer.LlamaPeer(tmp_path / "t.gguf")
    assert peer.generate("llama-plain", [1], 3, stop=[6]) == [5, 6]
    assert peer.generate("llama-plain", [1], 1, stop=[6]) == [5]
    assert peer.generate("llama-plain", [1], 9, stop=[]) == [5, 6, 7]


def test_kernel_ab_times_each_build_per_call_in_turns_and_gives_each_turns_ratio(monkeypatch):
    """`in_turns` on a fake clock: the warm-up rounds count in no figure, each figure is the reduce (min for
    products, median for passes) of the timed turns divided by the calls a turn, and each turn's ratio is this
    tree's time over the base's (under 1: this tree is faster), the figures `report` prints."""
    import statistics

    from benchmarks import kernel_ab
    from utils.models import kernel_choice
    from utils.models.kernel_choice import WARMUP

    clock = [0.0]
    monkeypatch.setattr(kernel_choice, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = {"base": [], "this tree": []}
    # seconds of each call: the warm-up ones slow (a cold start), then a turn of base calls costs 2, 6 or 4 s
    base_turns, ours_turns = [50.0] * WARMUP + [1.0, 3.0, 2.0], [50.0] * WARMUP + [1.0, 1.0, 1.0]

    def call(name, turns):
        def run():
            calls[name].append(None)
            clock[0] += turns[(len(calls[name]) - 1) // 2]  # two calls a turn
        return run

    for reduce, base_seconds in ((statistics.median, 2.0), (min, 1.0)):
        for name in calls:
            calls[name].clear()
        timed = kernel_ab.in_turns({"base": (call("base", base_turns), 2), "this tree": (call("this tree", ours_turns), 2)},
                                   3, reduce)
        assert {name: len(made) for name, made in calls.items()} == {"base": 2 * (WARMUP + 3), "this tree": 2 * (WARMUP + 3)}
        assert timed == ({"base": base_seconds, "this tree": 1.0}, [1.0, 2 / 6, 2 / 4])


class CountedOps:
    """An op namespace whose calls are logged under a build's name (both builds here are this tree's ops)."""

    def __init__(self, name, log):
        import torch

        self.name, self.log, self.namespace = name, log, torch.ops.specdec

    def __getattr__(self, op):
        def call(*args):
            self.log.append((self.name, op))
            return getattr(self.namespace, op)(*args)
        return call


def test_kernel_ab_times_each_build_on_its_own_ops_and_checks_they_agree(monkeypatch, capsys):
    """`time_products` with small shapes: each build's own ops run its products (a late-bound lambda would time
    one build twice and call it a comparison), an interleaved type is timed interleaved and says so, and builds whose
    products differ are refused instead of timed."""
    import torch

    from benchmarks import kernel_ab
    from utils.models import qkernels
    from utils.models.model_loader import cache_root

    assert qkernels.ensure(cache_root()), qkernels.why()
    monkeypatch.setattr(kernel_ab, "PRODUCTS", (("Q4_K", 256, 1536), ("Q5_0", 256, 1536)))
    log, reduces = [], []
    real_in_turns = kernel_ab.in_turns
    monkeypatch.setattr(kernel_ab, "in_turns", lambda calls, repeats, reduce: reduces.append(reduce) or real_in_turns(
        calls, repeats, reduce))
    spaces = {"base": CountedOps("base", log), "this tree": CountedOps("this tree", log)}
    kernel_ab.time_products(spaces, [60], 1)
    assert reduces == [min, min]  # a hot product's best turn is its least disturbed one
    lines = [line for line in capsys.readouterr().out.splitlines() if "ms" in line]
    assert [line.split(":")[0] for line in lines] == ["Q4_K interleaved 256 x 1536, 60 rows", "Q5_0 256 x 1536, 60 rows"]
    products = [name for name, op in log if op == "gguf_mm"]
    assert products.count("base") == products.count("this tree") > 2 * 2  # the checks, then the timed calls
    assert ("base", "interleave") in log and ("this tree", "interleave") in log

    class Off(CountedOps):  # a build whose products are off by one
        def __getattr__(self, op):
            call = super().__getattr__(op)
            return (lambda *args: call(*args) + 1) if op == "gguf_mm" else call

    with pytest.raises(SystemExit, match="the builds disagree on a Q4_K product of 60 rows"):
        kernel_ab.time_products({"base": Off("base", log), "this tree": CountedOps("this tree", log)}, [60], 1)
    assert torch.ops.specdec is kernel_ab.torch.ops.specdec


class FakePasses:
    """A model that logs each pass (the build routed in, its width, cache on or off) and answers the logits the
    build it runs on gives (`logits_of`), with a cache that logs its rollbacks."""

    def __init__(self, log, logits_of=lambda ops: 0.0):
        self.log, self.logits_of = log, logits_of

    def __call__(self, input_ids, use_cache, logits_to_keep, past_key_values=None):
        import torch

        from utils.models import qkernels

        ops = qkernels.ops()
        self.log.append((ops if isinstance(ops, str) else "default", input_ids.shape[1], use_cache, logits_to_keep))
        return SimpleNamespace(logits=torch.full((1, 1, 4), self.logits_of(ops)))


def test_kernel_ab_passes_run_cache_off_from_40_rows_roll_back_and_leave_this_builds_ops(monkeypatch, capsys):
    """`time_passes` on a fake model: passes of 40 rows or more run without a cache (as the cache-off chat's do),
    narrower ones on the held cache, each rolled back so that every timed pass sees the same 200 positions; the
    builds' logits are compared first (different logits: refused), and the model is left on this build's ops, also
    when a build cannot run the model's layouts."""
    import statistics

    import torch

    from benchmarks import kernel_ab
    from utils import caching
    from utils.models import qkernels
    from utils.models.kernel_choice import WARMUP

    crops = []
    monkeypatch.setattr(caching, "new_cache", lambda model: SimpleNamespace(crop=crops.append))
    log, reduces = [], []
    real_in_turns = kernel_ab.in_turns
    monkeypatch.setattr(kernel_ab, "in_turns", lambda calls, repeats, reduce: reduces.append(reduce) or real_in_turns(
        calls, repeats, reduce))
    kernel_ab.time_passes("fake", FakePasses(log), {"base": "B", "this tree": "T"}, [4, 40], 1)
    assert reduces == [statistics.median, statistics.median]  # passes: the medians the docstring reports
    assert qkernels.ops() is torch.ops.specdec
    assert log[:3] == [("default", 200, True, 1), ("B", 60, False, 1), ("T", 60, False, 1)]  # held, then checked
    narrow, wide = [p for p in log[3:] if p[1] == 4], [p for p in log[3:] if p[1] == 40]
    assert len(narrow) + len(wide) == len(log) - 3
    assert len(narrow) == 2 * 8 * (WARMUP + 1) and all(p[2:] == (True, 4) for p in narrow)
    assert len(wide) == 2 * 2 * (WARMUP + 1) and all(p[2:] == (False, 1) for p in wide)
    assert [p[0] for p in narrow].count("B") == [p[0] for p in narrow].count("T")
    assert crops == [-4] * len(narrow)
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == [
        "fake pass, 4 rows", "fake pass, 40 rows, cache off"]

    with pytest.raises(SystemExit, match="the builds give different logits"):
        kernel_ab.time_passes("fake", FakePasses([], lambda ops: float(ops == "B")), {"base": "B", "this tree": "T"},
                              [4], 1)

    def old_base(ops):
        if ops == "B":
            raise RuntimeError("unknown type 114\nmore")
        return 0.0

    kernel_ab.time_passes("fake", FakePasses([], old_base), {"base": "B", "this tree": "T"}, [4], 1)
    assert "the base build cannot run them (unknown type 114): not timed" in capsys.readouterr().out
    assert qkernels.ops() is torch.ops.specdec


def test_a_pass_weight_runs_interleaved_only_in_whole_groups_of_8_rows_under_its_files_activations():
    """What native mode's gguf8 interleaves: the types of `qkernels.X8` and Q4_0 (as Q4_1) in whole groups of 8
    rows; others, and a weight whose rows do not fill the groups, run as in the file. The activations stay keyed by
    the file's type (Q4_0's), as the pass quantises them."""
    import torch

    from benchmarks.layer_kernels import interleaved_as_run
    from utils.models import qkernels
    from utils.models.gguf_blocks import synthetic_blocks
    from utils.models.model_loader import cache_root

    assert qkernels.ensure(cache_root()), qkernels.why()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    for name, rows, kind in (("Q4_0", 16, qkernels.X8["Q4_1"]), ("Q4_0", 12, qkernels.TYPES["Q4_0"]),
                             ("Q4_K", 16, qkernels.X8["Q4_K"]), ("Q4_K", 12, qkernels.TYPES["Q4_K"]),
                             ("Q5_0", 16, qkernels.TYPES["Q5_0"])):
        blocks = synthetic_blocks(name, rows, 256, generator=torch.Generator().manual_seed(rows)).data
        got = interleaved_as_run(name, 256, blocks, qkernels.TYPES[name])
        assert got[:2] == (name, 256) and got[3] == kind, (name, rows)
        xq = qkernels.quantize(x, name)
        product = torch.ops.specdec.gguf_mm(xq, got[2], got[3], 256)
        expected = torch.ops.specdec.gguf_mm(xq, blocks, qkernels.TYPES[name], 256)
        assert product.shape == (3, rows)
        torch.testing.assert_close(product, expected, rtol=1e-3, atol=1e-3)


def test_layer_kernels_reports_each_paths_median_and_each_passs_least(monkeypatch):
    """`time_paths` and `time_pass` on fixed samples: a shape's figure is the median of its turns (over a path
    other than the portable reference), a pass's the least; the token embeddings (a lookup) and 1-D weights are
    no products of a pass; with `--x8` the file's layout runs on the best path."""
    import numpy as np
    import torch

    from benchmarks import layer_kernels
    from utils.models import qkernels
    from utils.models.gguf_blocks import synthetic_blocks
    from utils.models.model_loader import cache_root

    assert qkernels.ensure(cache_root()), qkernels.why()
    products = []
    real_mm = torch.ops.specdec.gguf_mm
    monkeypatch.setattr(torch.ops.specdec, "gguf_mm", lambda xq, b, kind, n, *path: products.append(
        (tuple(b.shape), kind, *path)) or real_mm(xq, b, kind, n, *path))

    def fixed(paths, call, repeats):
        for p in paths:
            call(p)
        return {p: [5.0, 1.0, 3.0, 4.0, 2.0] for p in paths}

    monkeypatch.setattr(layer_kernels, "interleaved", fixed)
    contenders = [p for p in qkernels.paths() if p != 0]
    times = layer_kernels.time_paths("Q4_K", 16, 256, (1, 4), x8=True)
    assert times == {p: {1: 3.0, 4: 3.0} for p in contenders}
    assert {kind for _, kind, *_ in products} == {qkernels.X8["Q4_K"]}

    def tensor(name, type_name, out, n):
        data = synthetic_blocks(type_name, out, n).data.numpy() if type_name != "F32" else np.zeros(n, np.float32)
        return SimpleNamespace(name=name, tensor_type=SimpleNamespace(name=type_name),
                               shape=(n, out) if type_name != "F32" else (n,), data=data)

    monkeypatch.setattr(layer_kernels, "file_tensors", lambda path: [
        tensor("token_embd.weight", "Q4_K", 24, 256), tensor("blk.0.attn_norm.weight", "F32", 0, 256),
        tensor("blk.0.attn_q.weight", "Q4_K", 16, 256), tensor("blk.0.ffn_down.weight", "Q5_0", 8, 256)])
    products.clear()
    times = layer_kernels.time_pass("fake.gguf", (1,), x8=True)
    best = qkernels.paths()[-1]
    as_in_file = f"{qkernels.PATHS[best]}, {'/'.join(qkernels.X8)}/Q4_0 as in the file"
    assert list(times)[0] == as_in_file and len(times) == 1 + len(contenders)
    assert all(figures == {1: 1.0} for figures in times.values())
    # a pass reads the two matrices, once per run, the file's layout on the best path, then the interleaved ones
    assert len(products) == 2 * len(times)
    assert products[:2] == [((16, 144), qkernels.TYPES["Q4_K"], best), ((8, 176), qkernels.TYPES["Q5_0"], best)]
    assert [kind for _, kind, _ in products[2:4]] == [qkernels.X8["Q4_K"], qkernels.TYPES["Q5_0"]]


def test_layer_kernels_without_built_kernels_times_no_path(monkeypatch, capsys):
    """--paths (with --x8 too) and --pass time our kernels alone: where they are not built, a note and nothing
    timed, rather than a traceback after minutes."""
    from benchmarks import layer_kernels
    from utils.models import qkernels

    monkeypatch.setattr(qkernels, "ensure", lambda root: False)
    monkeypatch.setattr(qkernels, "why", lambda: "no compiler")
    monkeypatch.setattr(layer_kernels, "time_paths", lambda *args: pytest.fail("timed without the kernels"))
    monkeypatch.setattr(layer_kernels, "print_pass", lambda *args: pytest.fail("timed without the kernels"))
    for argv in (["--paths", "--x8"], ["--paths"], ["--pass", "m", "--x8"]):
        layer_kernels.main(argv)
        assert capsys.readouterr().out == "note: no compiler\n", argv


def test_issue_rate_counts_are_whole_steps_and_rows_are_read_in_probe_order(monkeypatch, capsys):
    """The probe's loops issue eight instructions a step and its rates divide by the count: 12 or 0 would overstate
    them. Its output, one line a turn (turn, clock, then a rate per probe in PROBES' order), is read into rows, and
    the table's best row is each probe's highest rate (the least disturbed turn)."""
    import argparse

    from benchmarks import issue_rate
    from utils.models import kernel_choice

    assert issue_rate.eights("16") == 16
    for bad in ("12", "0", "4"):
        with pytest.raises(argparse.ArgumentTypeError):
            issue_rate.eights(bad)
    said = {}

    def step(what, command, timeout):
        said[what] = command
        return "0 3.10 1.0 2.0 3.0 4.0 5.0\n1 3.20 1.5 1.0 2.5 4.5 7.0\n" if what == "the probe" else ""

    monkeypatch.setattr(issue_rate, "run_step", step)
    rows = issue_rate.measure(800, 2)
    assert said["the probe"][1:] == ["800", "2"]
    assert rows[1] == {"turn": 1, "clock": 3.2, "maddubs": 1.5, "paddw": 1.0, "pair": 2.5, "fma": 4.5, "mixed": 7.0}
    monkeypatch.setattr(issue_rate, "supported", lambda: None)
    monkeypatch.setattr(kernel_choice, "cpu_facts", lambda: {"cpu": "cpu", "flags": ["avx2", "fma"]})
    issue_rate.main(["--repeats", "2", "--iterations", "800"])
    assert "| best | | 1.50 | 2.00 | 3.00 | 4.50 | 7.00 |" in capsys.readouterr().out


def test_native_vs_f32_reads_position_0_apart_and_the_largest_difference_after_it():
    """Position 0's logits are the largest and least useful of a prompt: its difference is reported apart, the
    others' as their largest (a mean would hide one bad position), and top-1 agreement counts positions after 0."""
    import torch

    from benchmarks.native_vs_f32 import differences

    reference = torch.tensor([[9.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    ours = reference.clone()
    ours[0] = torch.tensor([0.0, 0.0, 5.0])  # position 0: off by 9 and another top token
    ours[1, 0] = 2.0  # another top token, off by 2
    ours[2, 1] = 0.5  # the same top token, off by 0.5
    assert differences(ours, reference) == (9.0, 2.0, pytest.approx(2 / 3))


def test_kernel_ab_refuses_a_revision_whose_ops_are_not_all_renamed(monkeypatch, tmp_path):
    """Both the library and its implementations must move to `specdec_base`: a source whose implementations stay
    registered as `specdec` would load over this tree's own ops, and the comparison would time one build twice."""
    from benchmarks import kernel_ab

    files = {"qkernels.cpp": "TORCH_LIBRARY(specdec, m) {}\nTORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) {}\n",
             "matmul.cpp": "int f();\n"}

    def git(command, **kwargs):
        if command[3] == "ls-tree":
            return SimpleNamespace(returncode=0, stdout="\n".join(files), stderr="")
        return SimpleNamespace(returncode=0, stdout=files[command[-1].rsplit("/", 1)[1]], stderr="")

    monkeypatch.setattr(kernel_ab.subprocess, "run", git)
    with pytest.raises(SystemExit, match="are not registered as `specdec`"):
        kernel_ab.base_sources("old", tmp_path)
    files["qkernels.cpp"] = "TORCH_LIBRARY(specdec, m) {}\nTORCH_LIBRARY_IMPL(specdec, CPU, m) {}\n"
    assert [p.name for p in kernel_ab.base_sources("old", tmp_path)] == ["matmul.cpp", "qkernels.cpp"]


def fake_draft_stop_ab(monkeypatch, tmp_path, argv, seconds, tokens=None):
    """draft_stop_ab.main on stand-ins for the models and the loops: no loading, a clock that each method advances
    by `seconds[method]` (a list: one value a timed run, in turn), and the answer `tokens(method)`. Returns the
    timed calls (method, gamma, rule, seed) in the order they ran, and the rule configs made."""
    import json
    import sys

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"g": ["first prompt", "second"]}))
    clock, calls, made = [0.0], [], []
    left = {m: list(v) for m, v in seconds.items()}

    def ran(ids, method, gamma=None, rule=None):
        if ids != list(range(len("Hello"))):  # not the warm-up runs: those are left out of the figures
            calls.append((method, gamma, rule, torch.initial_seed()))
            clock[0] += left[method].pop(0)
        answer = tokens(method) if tokens else [5, 6, 7, 8]
        return SimpleNamespace(tokens=answer, rounds=2, drafted=6 if rule else 4, accepted=3)

    def speculative(ids, drafter, target, processor, settings, use_cache, draft_stop):
        method = draft_stop[1] if draft_stop else f"g{settings.gamma}"
        return ran(ids, method, settings.gamma, draft_stop and draft_stop[1])

    def make(config, drafter):
        made.append(config)
        return ("rule", config.rule)

    monkeypatch.setattr(draft_stop_ab, "load_model", lambda name, **kwargs: (SimpleNamespace(name=name), "tok"))
    monkeypatch.setattr(draft_stop_ab, "use_draft_vocab", lambda *args: None)
    monkeypatch.setattr(draft_stop_ab, "stop_tokens", lambda *args, **kwargs: [1])
    monkeypatch.setattr(draft_stop_ab, "chat_ids", lambda tokenizer, prompt: list(range(len(prompt))))
    monkeypatch.setattr(draft_stop_ab, "describe_cpu", lambda: "cpu")
    monkeypatch.setattr(draft_stop_ab, "make_draft_stop", make)
    monkeypatch.setattr(draft_stop_ab, "load_or_measure", lambda target, drafter, note=None: (
        5, SimpleNamespace(describe=lambda: "timed")))
    monkeypatch.setattr(draft_stop_ab, "autoregressive_run", lambda ids, *args: ran(ids, "ar"))
    monkeypatch.setattr(draft_stop_ab, "speculative_run", speculative)
    monkeypatch.setattr(draft_stop_ab, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(sys, "argv", ["draft_stop_ab", "--prompts", str(prompts), "--gammas", "1,2",
                                      "--max-new-tokens", "4", *argv])
    draft_stop_ab.main()
    return calls, made


def test_draft_stop_ab_alternates_methods_reseeds_repeats_and_compares_medians(monkeypatch, tmp_path, capsys):
    """The A/B's figures: each prompt's methods run forward then reversed (a drifting host weighs on all alike),
    each repeat from its own seed, every rule at its cap with its own rule object, tokens/s the answer's tokens
    (never the prompt's) over the run's time, medians over prompts and repeats (one slow outlier run must not move
    a method), and each rule against the fastest fixed length."""
    seconds = {"ar": [4] * 4, "g1": [2] * 4, "g2": [100, 1, 1, 1], "entropy": [0.5] * 4, "learned": [2] * 4}
    calls, made = fake_draft_stop_ab(monkeypatch, tmp_path, ["--stop-gamma", "3", "--seed", "7",
                                                             "--entropy-bound", "0.25"], seconds)
    forward = ["ar", "g1", "g2", "entropy", "learned"]
    assert [c[0] for c in calls] == (forward + forward[::-1]) * 2
    assert [c[3] for c in calls] == ([7] * 5 + [8] * 5) * 2  # repeat i samples from seed + i, every method alike
    assert {(c[0], c[1], c[2]) for c in calls if c[0] in ("entropy", "learned")} == {
        ("entropy", 3, "entropy"), ("learned", 3, "learned")}  # the rule itself, drafting at most its cap
    assert {(c[0], c[1], c[2]) for c in calls if c[0] in ("g1", "g2")} == {("g1", 1, None), ("g2", 2, None)}
    assert [(c.rule, c.entropy_bound) for c in made if c.rule == "entropy"] == [("entropy", 0.25)]
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == ("g: ar 1.00 g1 2.00 g2 4.00 entropy 8.00 learned 2.00 | best fixed g2; "
                    "entropy +100.0% (3.0 drafts a round, 50% accepted), learned -50.0% (3.0 drafts a round, "
                    "50% accepted)")


def test_draft_stop_ab_names_rules_by_cap_only_where_several_caps_run(monkeypatch, tmp_path, capsys):
    """`--stop-gamma 3,5,auto` with auto timed at 5: two caps, not three (5 runs once), and each rule runs at each
    under a name that says which; one cap leaves the names bare, as the other test reads them."""
    seconds = {m: [1.0] * 4 for m in ("ar", "g1", "g2", "entropy", "learned")}
    calls, made = fake_draft_stop_ab(monkeypatch, tmp_path, ["--stop-gamma", "3,5,auto", "--repeats", "1"],
                                     {m: v * 2 for m, v in seconds.items()})
    out = capsys.readouterr().out
    assert "rules at most 3/5 drafts" in out
    assert "entropy <=3" in out and "entropy <=5" in out and "learned <=5" in out
    assert sorted((c[2], c[1]) for c in calls if c[2]) == sorted(
        [("entropy", 3), ("entropy", 5), ("learned", 3), ("learned", 5)] * 2)


def test_draft_stop_ab_stops_on_a_greedy_answer_that_differs_and_lets_sampled_ones_differ(monkeypatch, tmp_path):
    """Greedy speculative decoding is lossless: a method writing another answer than the autoregressive one is a
    bug the A/B must stop on, not time; sampled answers differ by design and are not compared."""
    seconds = {m: [1.0] * 8 for m in ("ar", "g1", "g2", "entropy", "learned")}
    other = lambda method: [5, 6, 9] if method == "learned" else [5, 6, 7, 8]  # noqa: E731
    with pytest.raises(SystemExit, match="learned wrote another answer than ar on a g prompt"):
        fake_draft_stop_ab(monkeypatch, tmp_path, [], seconds, tokens=other)
    calls, _ = fake_draft_stop_ab(monkeypatch, tmp_path, ["--processor", "nucleus 0.7 0.9", "--repeats", "1"],
                                  seconds, tokens=other)
    assert len(calls) == 10


class WordTokenizer:
    """A stand-in for the drafter's tokenizer: a known word is its id, any other word id 0."""

    def __init__(self, ids: dict[str, int], size: int):
        self.ids, self.size = ids, size

    def __len__(self):
        return self.size

    def __call__(self, parts, add_special_tokens=False):
        return {"input_ids": [[self.ids.get(w, 0) for w in part.split()] for part in parts]}


def test_token_rank_counts_ranks_and_measures_coverage(tmp_path, monkeypatch):
    """The shortlist keeps the most frequent tokens first, ties in id order (BPE merge order), from the standard
    library's own sources (not its tests, not installed packages), each file cut to MAX_CHARS so that one long
    file does not outweigh the rest; every text counts, however many batches they take."""
    from benchmarks import token_rank

    for name, text in (("a.py", "0123456789"), ("pkg/b.py", "x"), ("test/c.py", "x"), ("site-packages/d.py", "x"),
                       ("e.txt", "x")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(token_rank, "sysconfig", SimpleNamespace(get_paths=lambda: {"stdlib": str(tmp_path)}))
    files = token_rank.corpus_files()
    assert files == [tmp_path / "a.py", tmp_path / "pkg" / "b.py"]
    monkeypatch.setattr(token_rank, "MAX_CHARS", 4)
    assert token_rank.texts(files) == ["0123", "x"]
    tokenizer = WordTokenizer({"one": 1, "three": 3, "five": 5}, 6)
    counts = token_rank.count(tokenizer, ["three"] * 70 + ["one one five"], 6)  # two batches of 64
    assert counts.tolist() == [0, 2, 0, 70, 0, 1]
    counts = torch.tensor([0, 5, 2, 5, 0, 0])
    rank = token_rank.ranking(counts)
    assert rank.tolist() == [1, 3, 2, 0, 4, 5]
    assert token_rank.coverage(rank, counts, [1, 2, 3]) == {1: 5 / 12, 2: 10 / 12, 3: 1.0}
    assert token_rank.coverage(rank, torch.zeros(6, dtype=torch.long), [2]) == {2: 0.0}  # no text: 0, not an error


def fake_token_rank(monkeypatch, tmp_path, argv):
    """token_rank.main on four one-word corpus files, stand-in prompt files and a 70000-token stand-in tokenizer
    whose words all rank past the largest shortlist unless counted."""
    import sys

    from benchmarks import token_rank

    files = []
    for i, text in enumerate(("wa wa", "wb wb wb", "wc", "wd wd wd wd")):
        files.append(tmp_path / f"f{i}.py")
        files[-1].write_text(text)
    words = {f"w{w}": 69990 + i for i, w in enumerate("abcd")} | {"wt": 69994, "wq": 69999}
    tokenizer = WordTokenizer(words, 70000)
    monkeypatch.setattr(token_rank, "load_model", lambda name, progress=False: (None, tokenizer))
    monkeypatch.setattr(token_rank, "corpus_files", lambda: files)
    monkeypatch.setattr(token_rank, "prompt_texts", lambda name: {"train_prompts.json": ["wt wt"],
                                                                  "prompts.json": ["wq wq wq"]}[name])
    monkeypatch.setattr(sys, "argv", ["token_rank", *argv])
    token_rank.main()


def test_token_rank_check_measures_text_it_did_not_count(tmp_path, monkeypatch, capsys):
    """--check's coverage is of held-out text: every other stdlib file and the benchmark's own prompts, none of
    which may be counted into the ranking it measures (a word seen only there must rank past every shortlist)."""
    fake_token_rank(monkeypatch, tmp_path, ["--check"])
    held, prompts = capsys.readouterr().out.splitlines()
    assert held.startswith("held-out stdlib (7 tokens) covered by the top N: 8192: 0.00%,") and "65536: 0.00%" in held
    assert prompts.startswith("benchmark prompts (3 tokens) covered by the top N: 8192: 0.00%,"), prompts


def test_token_rank_saves_the_top_ranks_and_what_they_came_from(tmp_path, monkeypatch):
    from benchmarks import token_rank

    monkeypatch.setattr(token_rank, "ROOT", tmp_path)
    monkeypatch.setattr(token_rank, "rank_file", lambda fingerprint: tmp_path / "ranks" / f"{fingerprint}.pt")
    monkeypatch.setattr(token_rank, "tokenizer_fingerprint", lambda vocabulary: "fp")
    monkeypatch.setattr(token_rank, "vocabulary", lambda tokenizer: {})
    fake_token_rank(monkeypatch, tmp_path, [])
    saved = torch.load(tmp_path / "ranks" / "fp.pt")
    # the KEPT most frequent: the four files' words and the training prompts' (never the benchmark's), then id order
    assert len(saved["ids"]) == token_rank.KEPT
    assert saved["ids"][:7].tolist() == [0, 69993, 69991, 69990, 69994, 69992, 1]
    assert (saved["provenance"]["files"], saved["provenance"]["seen"]) == (4, 6)  # pydoc's prose reads as id 0
