"""The real `infer.py`, driven in a pseudo-terminal with tiny random models passed as local folders."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from cli_models import write_tiny_model
from utils.chat.commands import COMMANDS
from utils.chat.interrupts import BURST_S

ROOT = Path(__file__).resolve().parents[1]
RED = "\x1b[31m"
PROMPT = "\n> "  # the prompt at the start of a line (error texts contain ">= ")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    write_tiny_model(base / "target", seed=0)
    write_tiny_model(base / "drafter", seed=1)
    return base / "target", base / "drafter"


def env(**extra):
    e = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", HOME=str(Path(os.environ.get("TMPDIR", "/tmp"))))
    e.pop("NO_COLOR", None)
    e.update(extra)
    return e


def spawn(folders, *args, repl: bool = True, preexec_fn=None, **env_extra):
    """infer.py in a pseudo-terminal; `repl`: waits for the chat's first prompt."""
    target, drafter = folders
    argv = ["infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32", *args]
    child = pexpect.spawn(sys.executable, argv, cwd=str(ROOT), env=env(FORCE_COLOR="1", **env_extra),
                          encoding="utf-8", timeout=120, dimensions=(50, 200), preexec_fn=preexec_fn)
    if repl:
        child.expect_exact(PROMPT)
    return child


def send(child, line: str) -> str:
    child.sendline(line)
    child.expect_exact(PROMPT)
    return child.before


def run_json(folders, *args) -> list[dict]:
    target, drafter = folders
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            "--json", *args]
    done = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_help_lists_every_command_with_its_value(folders):
    child = spawn(folders)
    out = send(child, "/help")
    for command in COMMANDS:
        assert f"/{command.name}" in out
    assert "[off]" in out and "[3]" in out and "[35]" in out and "greedy" in out
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_cache_warning_is_red(folders):
    child = spawn(folders)
    out = send(child, "/cache")
    assert "cache: on" in out
    assert RED in out and "unstable" in out
    out = send(child, "/cache")
    assert "cache: off" in out and "unstable" not in out
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


BAD_ARGUMENTS = [
    ("/gamma 0", "gamma: N must be an integer >= 1"),
    ("/gamma x", "gamma: N must be an integer >= 1"),
    ("/gamma", "usage: /gamma N"),
    ("/length -3", "length: N must be an integer >= 1"),
    ("/length 0", "length: N must be an integer >= 1"),
    ("/processor topk 0.8", "usage: topk T K"),
    ("/processor nucleus 1.0 1.5", "/processor: top_p must be a number in (0, 1]"),
    ("/processor multinomial 0", "temperature must be > 0"),
    ("/processor beam 1", "processor must be one of"),
    ("/top_k_filler 0", "top_k_filler: N must be an integer >= 1"),
    ("/set_ngramstorage basic 1", "N must be an integer from 2 to 16"),
    ("/set_ngramstorage trie 3", "/set_ngramstorage: argument 1 must be basic or onelevel, got 'trie'"),
    ("/seed 1.5", "seed: N must be an integer"),
    ("/gama 3", "unknown command '/gama'; did you mean /gamma?"),
    ("/gam 3", "unknown command '/gam'; did you mean /gamma?"),  # the one command it begins; difflib said /ngram
    ("/debug now", "usage: /debug (no arguments)"),
    ("/confidence 1", "confidence: P must be a number in [0, 1)"),
    ("/confidence -0.1", "confidence: P must be a number in [0, 1)"),
    ("/adaptive 3", "usage: /adaptive (no arguments)"),
    ("/draft_stop fast", "/draft_stop: draft stop must be one of: fixed; adaptive; confidence [P]"),
    ("/draft_stop entropy 2", "/draft_stop: the entropy bound must be in [0, 1)"),
    ("/draft_stop learned /no/head.pt", "/draft_stop: no acceptance head at /no/head.pt"),
    ("/file", "/file: give a file's path"),
    ("/drafter_window 3", "/drafter_window: a drafter window must be at least 8 positions"),
    ("/drafter_window all", "/drafter_window: N must be auto, 0 (all) or an integer >= 8, got 'all'"),
    ("/set_ngramstorage basic 17", "N must be an integer from 2 to 16"),
    ("/drafter_window 100000", "/drafter_window: a drafter window of 100000 positions is larger than the drafter's "
                               "context"),
    ("/file /no/such/prompt.txt", "/file: no file at /no/such/prompt.txt"),
]


def test_bad_arguments_leave_settings_unchanged(folders):
    child = spawn(folders)
    for line, expected in BAD_ARGUMENTS:
        out = send(child, line)
        assert RED in out and expected in out, line
        assert "Traceback" not in out
        after = send(child, "/help")
        assert re.search(r"/gamma N .*\[auto = 6\]", after) and re.search(r"/length N .*\[35\]", after), line
        assert re.search(r"/processor .*\[greedy 1\]", after), line
        assert re.search(r"/top_k_filler N .*\[3\]", after), line
        assert re.search(r"/set_ngramstorage .*\[basic 4\]", after) and re.search(r"/seed N .*\[42\]", after), line
        assert re.search(r"/debug .*\[off\]", after), line
        # the chat's default rule (utils/chat/settings.py's DEFAULT_DRAFT_STOP)
        assert re.search(r"/adaptive .*\[off\]", after) and re.search(r"/confidence P .*\[0.6\]", after), line
        assert re.search(r"/draft_stop RULE \[X\] .*\[auto = confidence 0.6\]", after), line
        assert re.search(r"/drafter_window N .*\[auto\]", after), line
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_every_command_changes_its_setting(folders, tmp_path):
    child = spawn(folders)
    for line, expected in [("/gamma AUTO", "gamma = auto = 6"), ("/gamma 6", "gamma = 6"), ("/length 7", "length = 7"), ("/seed 3", "seed = 3"),
                           ("/processor topknucleus 0.7 20 0.9", "processor = topknucleus 0.7 20 0.9"),
                           ("/top_k_filler 2", "top_k_filler = 2"), ("/set_ngramstorage onelevel 16", "onelevel n=16"),
                           ("/set_ngramstorage onelevel 4", "onelevel n=4"),
                           ("/reset_in_between", "reset_in_between: off"), ("/debug", "debug: on"),
                           ("/speculative", "speculative: off"), ("/ngram", "ngram: off"), ("/target", "target: off"),
                           ("/drafter", "drafter: off"), ("/chat", "chat: off"), ("/reset", "new conversation"),
                           ("/draft_stop Entropy 0.3", "draft stop = entropy 0.3"),
                           ("/adaptive", "adaptive gamma: on (draft stop = entropy 0.3 + adaptive)"),
                           ("/adaptive", "adaptive gamma: off (draft stop = entropy 0.3)"),
                           ("/draft_stop fixed", "draft stop = fixed"),
                           ("/adaptive", "adaptive gamma: on (draft stop = adaptive)"),
                           ("/adaptive", "adaptive gamma: off (draft stop = auto)"),
                           ("/adaptive", "adaptive gamma: on"),
                           ("/confidence 0.4", "confidence = 0.4 (draft stop = confidence 0.4 + adaptive)"),
                           ("/drafter_window 24", "drafter window = 24 (4 sinks + the 20 latest positions)")]:
        assert expected in send(child, line)
    child.sendline("/clear")
    child.expect_exact("\x1b[2J\x1b[H> ")
    out = send(child, "/help")
    for value in ["[6]", "[7]", "[3]", "[topknucleus 0.7 20 0.9]", "[2]", "[onelevel 4]", "[0.4]",
                  "[confidence 0.4 + adaptive]",
                  "[24]"]:
        assert value in out
    out = send(child, "hello world")  # every generator is off
    assert "every generator is off" in out
    assert "drafter: on" in send(child, "/drafter")
    out = send(child, "hello world")
    assert "drafter autoregressive" in out and "tokens/s" in out and "target autoregressive" not in out
    (tmp_path / "question.txt").write_text("write code :\n a function\n")
    out = send(child, f"/file {tmp_path / 'question.txt'}")  # a file's text as the prompt
    assert "(the prompt is" in out and "24 characters" in out and "drafter autoregressive" in out and "tokens/s" in out
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_empty_and_overlong_prompts(folders):
    child = spawn(folders)
    for blank in ("", " \t "):  # a line of spaces and tabs as Enter alone: one line, and the chat goes on
        out = send(child, blank)
        assert "tokens/s" not in out and "Traceback" not in out
        assert "the prompt is empty: type a prompt, or /help for the commands" in out
    out = send(child, " ".join(["hello"] * 5000))  # the tiny models' context is 4096
    assert RED in out and "context is 4096" in out
    assert "tokens/s" in send(child, "hello")  # the session goes on
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_report_and_debug_colours(folders):
    child = spawn(folders, "--length", "12")
    out = send(child, "write code")
    for title in ["target autoregressive", "speculative decoding", "NASD", "drafter autoregressive"]:
        assert title in out
    assert out.count("tokens/s") == 4 and "acceptance" in out and re.search(r"speedup \d+\.\d\dx", out)
    send(child, "/debug")
    out = send(child, "write code")
    assert "\x1b[34m" in out  # the target's own tokens in blue
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_ctrl_c_during_a_single_prompt_ends_the_line_then_says_interrupted(folders):
    child = spawn(folders, "--length", "3000", "--no-chat", "--generators", "target", "--prompt", "hello world",
                  repl=False)
    child.expect("target autoregressive")
    time.sleep(2)  # streaming: its 3000 tokens take ~45 s
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    tail = child.before.rstrip()
    assert re.search(r"\n\x1b\[31minterrupted\x1b\[0m$", tail), repr(tail[-80:])  # on a line of its own


def test_ctrl_c_stops_a_generation_and_the_session_goes_on(folders, tmp_path):
    child = spawn(folders, "--length", "3000", "--no-chat")
    child.sendline("hello world")
    child.expect("target autoregressive")
    child.expect(r"w\d+")  # it is streaming
    child.sendintr()
    child.sendintr()  # an impatient double press: the second ended the chat where it came as the first was reported
    child.expect("generation interrupted")
    child.expect_exact(PROMPT)
    child.sendintr()  # and a third, right as the prompt is back: the same burst, a new prompt
    time.sleep(0.3)  # (not typed into the line the press ends)
    child.sendline("/length 3")  # (as many prompts before its answer as presses of the burst reached one)
    child.expect_exact("length = 3")
    child.expect_exact(PROMPT)
    assert "tokens/s" in send(child, "hello")
    os.mkfifo(tmp_path / "fifo")  # /file waits for a writer: Ctrl-C there interrupts no generation
    child.sendline(f"/file {tmp_path / 'fifo'}")
    time.sleep(1)
    child.sendintr()
    child.expect_exact(PROMPT)
    assert "interrupted" in child.before and "generation interrupted" not in child.before
    time.sleep(BURST_S + 0.2)
    child.sendintr()  # Ctrl-C at an empty prompt leaves, once no longer part of the press that stopped /file
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_leaves_the_prompt_even_where_the_parent_left_sigint_ignored(folders):
    # A process may start with SIGINT ignored, inherited (the full suite's workers once passed it on here, from code
    # not found). Python keeps an inherited SIG_IGN, so Ctrl-C at the prompt did nothing and the session could not be
    # left with it; answers already took it (interrupts.take_ctrl_c)
    ignored = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
    child = spawn(folders, "--length", "3000", "--no-chat", preexec_fn=ignored)
    child.sendline("hello world")
    child.expect(r"w\d+")  # it is streaming
    child.sendintr()
    child.expect("generation interrupted")
    child.expect_exact(PROMPT)
    time.sleep(BURST_S + 0.2)
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_no_colour_without_a_tty_or_with_no_color(folders):
    target, drafter = folders
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32"]
    done = subprocess.run(argv, cwd=ROOT, env=env(), input="/cache\n/gamma 0\n", capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "\x1b[" not in done.stdout and "unstable" in done.stdout
    child = spawn(folders, NO_COLOR="1")
    child.sendline("/cache")
    child.expect_exact(PROMPT)
    assert "\x1b[31m" not in child.before


def test_help_names_every_environment_variable_the_program_reads():
    """`--help` ends with the variables; one the code starts to read without naming it there fails here."""
    read = re.compile(r'(?:environ\.get\(|environ\[|getenv\()\s*"(SPECDEC_[A-Z0-9_]+)"')
    sources = [ROOT / "infer.py", *(path for folder in ("utils", "sampling", "ngram_assisted")
                                    for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".h", ".cpp"))]
    names = {name for path in sources for name in read.findall(path.read_text())}
    assert {"SPECDEC_CACHE_DIR", "SPECDEC_QKERNELS", "SPECDEC_AMX"} <= names  # the pattern finds Python's and C++'s
    done = subprocess.run([sys.executable, "infer.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    environment = done.stdout[done.stdout.index("Environment:"):]
    assert set(re.findall(r"SPECDEC_[A-Z0-9_]+", environment)) == names
    assert "NO_COLOR" in environment and "FORCE_COLOR" in environment


def test_json_output_and_greedy_generators_agree(folders):
    target, _ = folders
    for args in [("--drafter", str(target)), ("--drafter", str(target), "--cache"),
                 ("--drafter", str(target), "--adaptive", "--confidence", "0.9995")]:
        reports = run_json(folders, "--prompt", "write a function", "--length", "20", *args)
        assert [r["generator"] for r in reports] == ["target", "speculative", "ngram", "drafter"]
        texts = {r["text"] for r in reports}
        assert len(texts) == 1 and texts != {""}
        for r in reports:
            assert r["tokens_per_s"] > 0 and r["tokens_generated"] == len(r["token_ids"]) > 0
            # generated tokens only (not the prompt's) over the answer's time; speedup against the target's rate
            assert r["tokens_per_s"] == pytest.approx(r["tokens_generated"] / r["seconds"])
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / reports[0]["tokens_per_s"])
        assert reports[1]["acceptance_rate"] == 1.0  # the drafter is the target
        nasd = reports[2]["acceptance_rate"]  # null when the storage drafted nothing
        assert (nasd is None or 0.0 <= nasd <= 1.0) and reports[0]["acceptance_rate"] is None
        assert reports[0]["speedup"] == 1.0


def test_the_seed_flag_decides_the_sampled_answers(folders):
    """--seed reaches the generators: the same seed, the same sampled answers; another, other ones."""
    def answers(seed):
        reports = run_json(folders, "--prompt", "write a function", "--length", "16", "--processor",
                           "multinomial 1", "--seed", str(seed), "--generators", "target,drafter")
        return [r["token_ids"] for r in reports]

    first = answers(1)
    assert answers(1) == first and answers(2) != first


def test_the_drafter_alone_runs_the_drafter_model(folders):
    """With --prompt, a drafter no generator needs is not loaded; the drafter alone needs it (it answered with the
    target under a mutation that skipped it)."""
    def drafter_answer(generators):
        reports = run_json(folders, "--prompt", "write a function", "--length", "12", "--generators", generators)
        return {r["generator"]: r["token_ids"] for r in reports}

    alone, beside = drafter_answer("drafter"), drafter_answer("target,speculative,drafter")
    assert alone["drafter"] == beside["drafter"] != beside["target"]


def test_int8_drafter_is_the_default_and_changes_no_answer(folders):
    target, drafter = folders
    for flags, int8 in (((), True), (("--no-int8-drafter",), False)):
        argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
                "--device", "cpu", "--json", "--prompt", "write a function", "--length", "20", "--cache", *flags]
        done = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        reports = {r["generator"]: r for r in map(json.loads, done.stdout.splitlines())}
        assert reports["speculative"]["token_ids"] == reports["target"]["token_ids"]
        assert reports["speculative"]["acceptance_rate"] < 1.0  # a different drafter: some drafts are rejected
        assert ("int8 linear layers" in done.stderr) == int8  # the start-up line says which drafter runs


def test_bad_model_paths_are_one_line(folders, tmp_path):
    target, _ = folders
    for spec in [str(tmp_path / "missing"), str(tmp_path / "nope.gguf")]:
        done = subprocess.run([sys.executable, "infer.py", "--target", spec, "--drafter", str(target)], cwd=ROOT,
                              env=env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_drafter_with_another_vocabulary_is_translated(folders, tmp_path):
    """The target's words under other ids, some missing, some extra: accepted, said so, and still lossless."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from cli_models import CHAT_TEMPLATE, WORDS

    target, _ = folders
    other = tmp_path / "other"
    words = list(reversed(WORDS[4:])) + ["<unk>", "<eos>", "<|im_end|>", "<|im_start|>", "extra"]
    words.remove("w7")  # missing: read as <unk>
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                        additional_special_tokens=["<|im_end|>", "<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
    tokenizer.save_pretrained(other)
    for cache in ("--no-cache", "--cache"):
        done = subprocess.run([sys.executable, "infer.py", "--target", str(target), "--drafter", str(other), "--dtype",
                               "float32", "--json", "--prompt", "write a function", "--length", "20", cache],
                              cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "vocabularies differ (the drafter's vocabulary does not match the target's)" in done.stderr
        reports = {r["generator"]: r for r in map(json.loads, done.stdout.splitlines())}
        assert reports["speculative"]["token_ids"] == reports["target"]["token_ids"]
        # auto: its drafts are text, with no distribution to read, and no timed cap
        assert reports["speculative"]["draft_stop"] == "adaptive" and reports["speculative"]["gamma"] == 6
        assert reports["drafter"]["error"] is None and reports["drafter"]["tokens_generated"] > 0
        assert reports["drafter"]["speedup"] is None  # its tokens are not the target's: no ratio of their rates


def test_a_target_drafting_for_itself_shows_its_whole_head_in_help(folders):
    child = spawn((folders[0], folders[0]))
    out = send(child, "/help")
    assert re.search(r"/draft_vocab N .*\[all\]", out)
    assert "the drafter is the target" in send(child, "/draft_vocab 5")
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_one_answer_without_a_drafter_generator_does_not_load_the_drafter(folders, tmp_path):
    """`--generators target,ngram --prompt …` never uses the drafter: it was loaded all the same (memory, time; a
    user's sweep). A drafter that cannot even be found shows it is not read; one that is used still is."""
    target, _ = folders
    missing = str(tmp_path / "no-drafter")
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", missing, "--dtype", "float32",
            "--json", "--length", "4", "--prompt", "hello world"]
    # (a learned draft stop has no drafter to be checked against: not built either)
    done = subprocess.run([*argv, "--generators", "target,ngram", "--draft-stop", "learned"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [json.loads(line)["generator"] for line in done.stdout.splitlines()] == ["target", "ngram"]
    assert "drafter not loaded: no generator of this answer uses it" in done.stderr
    used = subprocess.run([*argv, "--generators", "target,speculative"], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert used.returncode == 1 and "no-drafter" in used.stderr and "Traceback" not in used.stderr


def test_the_command_lines_defaults_are_the_chats_own():
    """infer.py writes its option defaults out (importing `Settings` would load torch before `--help`): they must
    stay those of the chat's `Settings` and of the loader, or the chat would start otherwise than `/help` says."""
    import inspect

    import infer
    from utils.chat.settings import Settings, parse_gamma, parse_generators, parse_processor, parse_window
    from utils.models.model_loader import DEFAULT_DRAFTER, DEFAULT_TARGET

    cli = {name: p.default.default for name, p in inspect.signature(infer.main).parameters.items()}
    chat = Settings()
    assert (cli["target"], cli["drafter"]) == (DEFAULT_TARGET, DEFAULT_DRAFTER)
    assert (cli["length"], cli["seed"], cli["cache"], cli["debug"], cli["ngram_prior"]) == (
        chat.length, chat.seed, chat.use_cache, chat.debug, chat.ngram_prior)
    assert parse_gamma(cli["gamma"]) == chat.gamma and parse_window(cli["drafter_window"]) == chat.drafter_window
    assert repr(parse_processor(cli["processor"].split())) == repr(chat.processor)  # processors compare by identity
    assert parse_generators(cli["generators"]) == chat.enabled


def test_the_command_lines_values_are_the_chats_at_the_start(folders):
    """Each option that a command also sets starts the chat at the value given, as /help shows it (the largest seed
    torch takes among them)."""
    child = spawn(folders, "--gamma", "3", "--length", "7", "--processor", "multinomial 0.5", "--seed",
                  "18446744073709551615", "--draft-stop", "fixed", "--cache", "--debug")
    out = send(child, "/help")
    assert re.search(r"/gamma N .*\[3\]", out) and re.search(r"/length N .*\[7\]", out), out
    assert re.search(r"/processor .*\[multinomial 0.5\]", out), out
    assert re.search(r"/seed N .*\[18446744073709551615\]", out), out
    assert re.search(r"/draft_stop RULE \[X\] .*\[fixed\]", out), out
    assert re.search(r"/cache .*\[on\]", out) and re.search(r"/debug .*\[on\]", out), out
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_the_start_line_notes_the_drafters_window_only_where_the_drafter_runs(folders):
    """The start line's notes follow the models' line in one order (the drafter's head, the KV budget, the drafter's
    window: what each bound keeps); the window is noted only where a generator of the answer drafts with it."""
    target, drafter = folders
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            "--json", "--prompt", "hello world", "--length", "2", "--drafter-window", "16", "--kv-budget", "40",
            "--cache"]
    note = "drafter window 16 (4 sinks + the 12 most recent positions)"
    done = subprocess.run([*argv, "--generators", "speculative"], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stderr.splitlines() if "KV budget 40" in line)
    assert line.index("drafter ") < line.index("KV budget 40") < line.index(note), line
    alone = subprocess.run([*argv, "--generators", "target"], cwd=ROOT, env=env(), capture_output=True, text=True,
                           timeout=300)
    assert alone.returncode == 0 and "KV budget 40" in alone.stderr and "drafter window" not in alone.stderr
