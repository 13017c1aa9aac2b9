"""Hostile input to the real `infer.py`: each case gets one clear line and the session (or the exit) goes on."""

import json
import os
import signal
import subprocess
import sys
import time

import pexpect
import pytest

from cli_models import WORDS, write_tiny_model
from conftest import tiny_encoder_decoder
from test_cli import PROMPT, RED, ROOT, env, folders, send, spawn  # noqa: F401 (folders: the fixture)


def one_shot(folders, *args, extra_env=None, timeout=300):
    target, drafter = folders
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32", *args]
    return subprocess.run(argv, cwd=ROOT, env=env(**(extra_env or {})), capture_output=True, timeout=timeout)


def test_one_shot_prompt_starting_with_a_slash_is_a_prompt(folders):
    done = one_shot(folders, "--json", "--prompt", "/etc/hosts: what is this file?", "--length", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["generator"] for r in reports] == ["target", "speculative", "ngram", "drafter"]


def test_generators_choose_who_answers_in_the_usual_order(folders):
    """Issue 22: a user with a long prompt picks the generators instead of waiting for four prefills."""
    done = one_shot(folders, "--json", "--prompt", "hello world", "--length", "4", "--generators", "ngram, Target")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [json.loads(line)["generator"] for line in done.stdout.splitlines()] == ["target", "ngram"]


def test_a_prompt_file_is_the_prompt(folders, tmp_path):
    (tmp_path / "q.txt").write_text("hello world\n")
    by_file = one_shot(folders, "--json", "--prompt-file", str(tmp_path / "q.txt"), "--length", "4",
                       "--generators", "target")
    by_text = one_shot(folders, "--json", "--prompt", "hello world", "--length", "4", "--generators", "target")
    assert by_file.returncode == 0, by_file.stderr[-2000:]
    assert json.loads(by_file.stdout)["text"] == json.loads(by_text.stdout)["text"]


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_one_shot_prompt_is_refused_before_loading(folders, prompt):
    done = one_shot(folders, "--json", "--prompt", prompt)
    stderr = done.stderr.decode()
    assert done.returncode == 2 and "--prompt is empty" in stderr and done.stdout == b""
    assert "target " not in stderr and len(stderr.strip().splitlines()) == 1  # no model was loaded


@pytest.mark.parametrize("args, message", [
    (["--seed", "18446744073709551616"], "--seed must be an integer from -2**63 to 2**64-1"),
    (["--prompt", b"caf\xe9 ol\xe9".decode("utf-8", "surrogateescape")], "--prompt is not valid UTF-8"),
    (["--generators", "target,beam"], "--generators: unknown 'beam'; use a comma-separated list of target, "),
    (["--generators", " , "], "--generators: no generator named"),
    (["--prompt-file", "/no/such/prompt.txt"], "--prompt-file: no file at /no/such/prompt.txt"),
    (["--prompt", "hello", "--prompt-file", "x.txt"], "--prompt and --prompt-file: give one of them"),
    (["--drafter-window", "3"], "--drafter-window: a drafter window must be at least 8 positions"),
    (["--kv-policy", "lru"], "--kv-policy: unknown policy 'lru'; use one of streaming, h2o, snapkv"),
    (["--kv-policy", "h2o", "--kv-budget", "64"], "--kv-policy h2o: it evicts from a bounded KV cache: give "
                                                  "--kv-budget N and --cache"),
    (["--kv-policy", "snapkv", "--kv-budget", "64"], "--kv-policy snapkv: it evicts from a bounded KV cache: give "
                                                     "--kv-budget N and --cache"),
    (["--draft-stop", "fast"], "--draft-stop: draft stop must be one of: fixed; adaptive;"),
    (["--draft-stop", "entropy", "--confidence", "0.5"], "--draft-stop: --confidence is an older spelling of "
                                                          "--draft-stop: give one of them"),
    (["--draft-stop", "entropy", "--adaptive"], "--draft-stop: --adaptive is an older spelling of"),
    (["--dtype", "foo"], "--dtype: unknown dtype 'foo'; use auto, native, float32, bfloat16 or float16"),
    (["--kernels", "avx"], "--kernels: unknown kernels 'avx'; use auto, gguf, gguf8, int4, bf16 or f32"),
    (["--device", "tpu"], "--device: unknown device 'tpu'; use auto, cpu, cuda or mps"),
    (["--target", " "], "--target: give an embedded name, a Hugging Face id, a folder or a .gguf file"),
    (["--drafter", " "], "--drafter: give an embedded name, a Hugging Face id, a folder or a .gguf file"),
    (["--ngram-cache", ""], "--ngram-cache: give a file's path"),
    (["--ngram-cache", "/no/such/dir/x.ngram"], "--ngram-cache: no folder /no/such/dir to keep x.ngram in"),
    (["--ngram-cache", "/"], "--ngram-cache: / is a folder; give a file's path"),
    (["--gamma", "0"], "--gamma: must be an integer >= 1, or auto, got '0'"),
    (["--confidence", "1"], "--confidence: P must be a number in [0, 1), got 1"),  # /confidence's range
    (["--confidence", "-0.5"], "--confidence: P must be a number in [0, 1), got -0.5"),
    (["--gamma", "many"], "--gamma: must be an integer >= 1, or auto, got 'many'"),
    # typer's own checks, in one line too; their wording changes between typer's releases (0.29 checks through
    # pydantic: "Input should be greater than or equal to 1"; older ones leave it to click, in its words)
    (["--seed", "1e3"], "--seed: "),
    (["--bogus"], "No such option: --bogus (--help lists the options)"),
])
def test_a_bad_value_is_a_usage_error_before_any_model_is_read(tmp_path, args, message):
    """One line named by its option, status 2 as typer's own usage errors, before minutes of loading: the target
    here does not exist, and is never looked for."""
    missing = tmp_path / "no-such-model"
    done = one_shot((missing, missing), *args)
    stderr = done.stderr.decode()
    assert done.returncode == 2 and message in stderr, stderr[-2000:]
    assert "no-such-model" not in stderr and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message, status", [
    (["--device", "mps"], "no MPS device", 1),  # the loader's: a device this machine lacks
    (["--drafter-window", "100000"], "--drafter-window: a drafter window of 100000 positions is larger than the "
                                     "drafter's context", 2),
    (["--kv-budget", "100000"], "--kv-budget: a KV budget of 100000 positions is larger than the model's context "
                                "of 4096 (the target)", 2),
    (["--draft-stop", "learned"], "--draft-stop: the acceptance head qwen2.5-coder-0.5b-instruct.pt was trained "
                                  "for another drafter", 2),  # the shipped head, against the tiny drafter
])
def test_a_value_the_models_refuse_is_one_line(folders, args, message, status):
    """Values that only the loaded models can judge: one line too, usage errors still status 2."""
    done = one_shot(folders, *args)
    stderr = done.stderr.decode()
    assert done.returncode == status and message in stderr, stderr[-2000:]
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1


def test_kernels_asked_for_where_no_model_runs_gguf_blocks_is_named(folders):
    done = one_shot(folders, "--json", "--prompt", "hello", "--length", "2", "--generators", "target",
                    "--kernels", "int4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert b"--kernels int4 has no effect: no model runs GGUF blocks natively" in done.stderr


def test_kernels_f32_on_a_native_model_is_no_note(tmp_path):
    """The review's case: f32 kernels label the model `float32`, which the first check took for a dense one."""
    from gguf_models import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True)
    done = one_shot((gguf, gguf), "--json", "--prompt", "hello", "--length", "2", "--generators", "target",
                    "--kernels", "f32", "--dtype", "auto", "--device", "cpu",
                    extra_env={"SPECDEC_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert b"has no effect" not in done.stderr
    assert b"tiny.gguf \xc2\xb7 float32\n" in done.stderr  # the target runs the kernels asked for, not auto's choice


def test_no_int4_drafter_runs_the_drafter_files_own_blocks(tmp_path):
    """By default the drafter's 5-, 6- and 8-bit layers are re-quantised to 4 bits; --no-int4-drafter reaches the
    loader, and the drafter runs the blocks its file holds."""
    from gguf_models import write_tiny_gguf

    pair = [write_tiny_gguf(tmp_path / f"{role}.gguf", seed=seed, tokenizer=True)
            for seed, role in enumerate(("target", "drafter"))]
    lines = {}
    for flag in ("--int4-drafter", "--no-int4-drafter"):
        # --kernels gguf: the blocks the file holds on any CPU, where auto's timing may pick a float copy
        done = one_shot(pair, "--json", "--prompt", "hello", "--length", "2", "--generators", "speculative",
                        "--dtype", "auto", "--device", "cpu", "--kernels", "gguf", flag,
                        extra_env={"SPECDEC_CACHE_DIR": str(tmp_path / "cache")})
        assert done.returncode == 0, done.stderr[-2000:]
        lines[flag] = next(line for line in done.stderr.decode().splitlines() if line.startswith("drafter "))
    assert "Q8_0" in lines["--no-int4-drafter"] and "re-quantised" not in lines["--no-int4-drafter"]
    assert "Q8_0" not in lines["--int4-drafter"] and "re-quantised to 4 bits" in lines["--int4-drafter"]


def test_transformers_dequantization_bar_stays_off_a_log(tmp_path):
    """--dtype float32 on a .gguf: transformers' own tqdm ("Converting and de-quantizing GGUF tensors…") wrote its
    carriage-return frames into a pipe, where ours write nothing."""
    from gguf_models import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True)
    done = one_shot((gguf, gguf), "--json", "--prompt", "hello", "--length", "2", "--generators", "target",
                    extra_env={"SPECDEC_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert b"\r" not in done.stderr and b"de-quantizing" not in done.stderr
    assert b"float32" in done.stderr  # the start line, which a bar would have preceded


def test_encoder_decoder_folder_is_refused(folders, tmp_path):
    from transformers import AutoTokenizer

    tiny_encoder_decoder("bart").save_pretrained(tmp_path / "bart")
    AutoTokenizer.from_pretrained(folders[0]).save_pretrained(tmp_path / "bart")
    done = one_shot((tmp_path / "bart", folders[1]), "--prompt", "hello")
    stderr = done.stderr.decode()
    assert done.returncode == 1 and "encoder-decoder model (bart)" in stderr and "Traceback" not in stderr


def test_an_ngram_cache_under_the_home_folder_is_written_there(folders, tmp_path):
    """`--ngram-cache=~/chat.ngram` reaches the program with its "~" (a shell expands it only at a word's start):
    it is the home folder's file, not a folder named "~" that does not exist."""
    done = one_shot(folders, "--prompt", "hello world", "--length", "4", "--generators", "ngram",
                    "--ngram-cache=~/chat.ngram", extra_env={"HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "chat.ngram").stat().st_size > 0


def test_unwritable_cache_folder_is_one_line(folders, tmp_path):
    (tmp_path / "file").write_text("")
    # the embedded default, prepared into the cache (native mode: on CPU even where a GPU is, which would load it
    # dense and first ask for its packages, which a machine running only the tests may lack)
    argv = [sys.executable, "infer.py", "--prompt", "hello", "--device", "cpu"]
    done = subprocess.run(argv, cwd=ROOT, env=env(SPECDEC_CACHE_DIR=str(tmp_path / "file" / "cache")),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "cannot be written" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("value, valid", [("abc", False), ("0", False), ("1.5", False), ("", False),
                                          ("9223372036854775808", False), ("1\u00a0", False), (" +1, 1", True)])
def test_an_invalid_thread_count_in_the_environment_is_our_one_note(folders, value, valid):
    """libgomp printed its own "Invalid value for environment variable OMP_NUM_THREADS" as torch loaded."""
    done = one_shot(folders, "--json", "--prompt", "hello", "--length", "1", "--generators", "target",
                    extra_env={"OMP_NUM_THREADS": value})
    assert done.returncode == 0, done.stderr[-2000:]
    assert b"libgomp" not in done.stderr
    note = f"note: OMP_NUM_THREADS={value!r} is not a number of threads".encode()
    assert (note in done.stderr) != valid


def test_nothing_drafted_reports_null_acceptance_and_forwards_per_model(folders):
    done = one_shot(folders, "--json", "--prompt", "hello world", "--length", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    reports = {r["generator"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert reports["speculative"]["acceptance_rate"] is None and reports["ngram"]["acceptance_rate"] is None
    assert reports["drafter"]["target_forwards"] == 0 and reports["drafter"]["drafter_forwards"] == 1
    assert reports["target"]["target_forwards"] == 1 and reports["target"]["drafter_forwards"] == 0


def test_repl_escapes_invalid_utf8_huge_seed_and_a_full_context(tmp_path):
    write_tiny_model(tmp_path / "short", seed=0, context=40)
    child = spawn((tmp_path / "short", tmp_path / "short"), "--no-chat", "--length", "30")
    out = send(child, "/help")
    assert "start it with // to send one that begins with /" in out
    out = send(child, "//etc/hosts w1 w2")
    assert "tokens/s" in out and "unknown command" not in out
    for line, message in [("/seed 99999999999999999999999", "seed: N must be an integer from -2**63 to 2**64-1"),
                          ("/processor multinomial 1e-40", "temperature must be in [1e-06, 1e+06]"),
                          ("/processor topk inf 5", "temperature must be > 0 and finite"),
                          ("/set_ngramstorage basic 10000000", "N must be an integer from 2 to 16")]:
        out = send(child, line)
        assert RED in out and message in out, line
    assert "[42]" in send(child, "/help")  # the seed is unchanged
    out = send(child, " ".join(["w1"] * 25))  # 25 prompt tokens + 30 to generate > 40
    assert "tokens/s" in out and "the answer stopped because the context of 40 tokens is full)" in out
    assert "/reset" not in out  # chat off: there is no conversation to start again
    out = send(child, "w1 w2")
    assert "context" not in out  # a short answer that fits says nothing
    child.sendline("/quit")
    child.expect(pexpect.EOF)


@pytest.mark.parametrize("locale", ["C.UTF-8", "C"])
def test_piped_input_that_is_not_utf8_is_named(folders, locale):
    """Piped bytes reach input() strictly decoded (UnicodeDecodeError) or as surrogates, by locale: both named."""
    target, drafter = folders
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            "--no-chat", "--length", "3"]
    done = subprocess.run(argv, cwd=ROOT, env=env(LC_ALL=locale), input=b"caf\xe9 w1\nw1 w2\n", capture_output=True,
                          timeout=300)
    stdout = done.stdout.decode("utf-8", "replace")
    assert done.returncode == 0 and "the input is not valid UTF-8" in stdout and "Traceback" not in stdout
    assert stdout.count("tokens/s") == 4  # the next prompt is answered by every generator


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_an_output_encoding_that_lacks_the_chats_characters_still_answers(folders, encoding):
    """A sweep: PYTHONIOENCODING=ascii ended at the start line's "·" with a boxed UnicodeEncodeError traceback;
    latin-1 printed the start line, then "error: UnicodeEncodeError" at a heading's "──", and no answer. A
    character the encoding lacks is now "?"; piped bytes it cannot decode are named as from a UTF-8 terminal."""
    target, drafter = folders
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            "--no-chat", "--length", "3"]
    typed = "w1 w2\ncaf\u00e9 \u2500\n".encode(encoding, "replace") + b"\xff w1\n"  # \xff: not ASCII, latin-1's "ÿ"
    done = subprocess.run(argv, cwd=ROOT, env=env(PYTHONIOENCODING=encoding), input=typed, capture_output=True,
                          timeout=300)
    stdout, stderr = done.stdout.decode(encoding), done.stderr.decode(encoding)
    assert done.returncode == 0, stderr[-2000:]
    assert "Traceback" not in stdout + stderr and "Error" not in stdout + stderr
    assert "?? target autoregressive ??" in stdout
    if encoding == "ascii":
        assert "the input is not valid UTF-8" in stdout and stdout.count("tokens/s") == 8  # two answered by all four
    else:
        assert stdout.count("tokens/s") == 12


def test_debug_without_colour_marks_kept_and_rejected_drafts(folders):
    target, drafter = folders
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            "--debug", "--length", "20", "--no-chat"]
    done = subprocess.run(argv, cwd=ROOT, env=env(), input="w1 w2 w3 hello world\n", capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "\x1b[" not in done.stdout
    assert "[-" in done.stdout and "-]" in done.stdout  # a different drafter: some drafts are rejected


def test_sigterm_saves_the_line_history(folders, tmp_path):
    child = spawn(folders, HOME=str(tmp_path))
    send(child, "/gamma 4")
    child.kill(signal.SIGTERM)
    child.expect(pexpect.EOF)
    child.close()
    assert child.signalstatus is None and child.exitstatus == 128 + signal.SIGTERM
    assert "/gamma 4" in (tmp_path / ".specdec_history").read_text()


def infer_with_broken_ngram(folders, *args):
    """infer.py with NASD raising an exception type the session has no reason to expect."""
    target, drafter = folders
    script = ("import sys\nimport utils.chat.session as session\n"
              "def broken(*args, **kwargs):\n    raise KeyError(-1)\n"
              "session.nasd_run = broken\nimport infer\nsys.argv = ['infer.py', *sys.argv[1:]]\ninfer.app()\n")
    argv = [sys.executable, "-c", script, "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            *args]
    return subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def test_one_generators_unexpected_exception_keeps_every_json_report(folders):
    """Issue 25: a KeyError ended the run with "error: KeyError: -1" and no JSON line at all."""
    done = infer_with_broken_ngram(folders, "--json", "--prompt", "hello world", "--length", "4")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    reports = {r["generator"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert list(reports) == ["target", "speculative", "ngram", "drafter"]
    assert reports["ngram"]["error"] == "KeyError: -1" and reports["ngram"]["token_ids"] == []
    assert all(reports[g]["error"] is None and len(reports[g]["token_ids"]) == 4 for g in ("target", "speculative", "drafter"))
    assert "ngram failed: KeyError: -1" in done.stderr


def test_a_crafted_ngram_cache_is_one_line_and_every_generator_answers(folders, tmp_path):
    import gzip

    from ngram_assisted.ngram_cache import FORMAT, VERSION, tokenizer_fingerprint
    from transformers import AutoTokenizer

    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(folders[0]))
    state = {"format": FORMAT, "version": VERSION, "kind": "basic", "n": 3, "vocab_size": len(WORDS),
             "tokenizer": fingerprint, "contexts": {"2": [], "1": [[[5], [[7, 1]], -1]]}}  # best -1: no follower
    crafted = tmp_path / "crafted.ngram"
    crafted.write_bytes(gzip.compress(json.dumps(state).encode()))
    done = one_shot(folders, "--json", "--prompt", "hello world", "--length", "4", "--ngram-cache", str(crafted))
    stderr = done.stderr.decode()
    assert done.returncode == 0 and "is corrupt (bad contents); NASD starts with an empty storage" in stderr
    assert [json.loads(line)["error"] for line in done.stdout.splitlines()] == [None] * 4


def test_an_unknown_users_home_as_a_spec_is_one_line(folders):
    done = one_shot(folders, "--target", "~nosuchuser-specdec/model", "--prompt", "hi")
    stderr = done.stderr.decode()
    assert done.returncode == 1 and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert "no model at ~nosuchuser-specdec/model: ~nosuchuser-specdec names no user of this system" in stderr


def test_the_chat_with_stdin_closed_ends_as_at_end_of_input(folders):
    """`exec 0<&-`: Python starts without sys.stdin and input() raised RuntimeError("input(): lost sys.stdin")."""
    target, drafter = folders
    argv = ["bash", "-c", 'exec 0<&- && exec "$@"', "bash", sys.executable, "infer.py", "--target", str(target),
            "--drafter", str(drafter), "--dtype", "float32"]
    done = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr + done.stdout, done.stderr[-2000:]
    assert "Type a prompt" in done.stdout and done.stderr == ""


@pytest.mark.parametrize("json_mode", [False, True])
def test_a_reader_that_leaves_ends_the_run_quietly(folders, json_mode):
    """`--prompt … | head -1`: "error: BrokenPipeError" and status 1. Here nobody reads stdout at all, so the very
    first line written there meets a closed pipe, as every later one would."""
    target, drafter = folders
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            "--prompt", "hello world", "--length", "4", *(["--json"] if json_mode else [])]
    read, write = os.pipe()
    child = subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=write, stderr=subprocess.PIPE, text=True)
    os.close(write)
    os.close(read)
    stderr = child.communicate(timeout=300)[1]
    assert child.returncode == 128 + signal.SIGPIPE, stderr[-2000:]
    assert "error" not in stderr.lower() and "Traceback" not in stderr
    if json_mode:
        assert stderr.count("tokens/s") == 4  # every answer was shown on stderr; only the JSON had nowhere to go


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device every write to fails")
@pytest.mark.parametrize("json_mode", [False, True])
def test_an_output_that_cannot_be_written_is_one_line(folders, json_mode):
    """stdout on a full disk (/dev/full): a traceback and status 1, where only BrokenPipeError was caught."""
    target, drafter = folders
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
            "--prompt", "hello world", "--length", "4", "--generators", "target", *(["--json"] if json_mode else [])]
    with open("/dev/full", "w") as full:
        done = subprocess.run(argv, cwd=ROOT, env=env(), stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].endswith("cannot write the output: No space left on device")
    assert "Exception ignored" not in done.stderr  # the interpreter's last flush does not fail again


def test_a_stdout_that_fails_mid_answer_is_left_to_the_one_line(monkeypatch):
    """The /dev/full test fails at the start-up line; a disk that fills while an answer streams raises inside
    `answer_once`, whose catch-all would print `error: OSError` and leave the buffered output to fail at exit."""
    import errno

    import typer

    monkeypatch.syspath_prepend(str(ROOT))
    import infer

    class Full:
        out, answering = sys.stderr, True

        def __init__(self, error):
            self.error = error

        def answer(self, prompt):
            raise self.error

    with pytest.raises(OSError):  # to main, which unplugs stdout and says it once
        infer.answer_once(Full(OSError(errno.ENOSPC, "No space left on device")), "hi", False)
    with pytest.raises(typer.Exit):  # a file's own error (it names the file) stays the answer's error line
        infer.answer_once(Full(OSError(errno.EIO, "Input/output error", "/models/x.gguf")), "hi", False)


def test_json_keeps_the_answers_finished_before_a_ctrl_c(monkeypatch, capsys):
    """stdout stayed empty: a consumer of --json lost the generators that had answered."""
    import typer

    monkeypatch.syspath_prepend(str(ROOT))
    import infer
    from utils.chat.report import Report

    class Stopped:
        out, answering = sys.stderr, True
        finished = [Report("target", "hi", [5], 1, 0.5, 2.0, None, None, 2, 0)]

        def answer(self, prompt):
            raise KeyboardInterrupt  # during the second generator

    with pytest.raises(typer.Exit) as stop:
        infer.answer_once(Stopped(), "hi", True)
    assert stop.value.exit_code == 130
    captured = capsys.readouterr()
    assert [json.loads(line)["generator"] for line in captured.out.splitlines()] == ["target"]
    assert captured.err.strip().endswith("interrupted")


def test_a_closed_stdout_is_named_before_anything_loads(folders):
    """`>&-`: Python starts without sys.stdout, print() drops everything, and the run ended 0 with the JSON lost."""
    target, drafter = folders
    argv = ["bash", "-c", 'exec 1>&- && exec "$@"', "bash", sys.executable, "infer.py", "--target", str(target),
            "--drafter", str(drafter), "--dtype", "float32", "--prompt", "hello", "--json"]
    done = subprocess.run(argv, cwd=ROOT, env=env(), stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip() == ("the standard output is closed: nothing could be shown "
                                                           "(open it, or send it to /dev/null)")
    # through a launcher script (pyenv's shim) the closed descriptor is the script's own, open for reading
    argv[2] = 'exec 1</dev/null && exec "$@"'
    done = subprocess.run(argv, cwd=ROOT, env=env(), stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 2 and "the standard output is closed" in done.stderr


@pytest.mark.parametrize("closed", ["2>&-", "2</dev/null"])
def test_a_closed_stderr_keeps_the_answers(folders, closed):
    """A sweep: `--json 2>&-` printed nothing and ended 1 under pyenv's shim, where descriptor 2 was the script,
    open for reading: the start line's write failed, taken for the terminal's failure. Without the shim Python
    has no sys.stderr (that ran before too)."""
    target, drafter = folders
    argv = ["bash", "-c", f'exec {closed} && exec "$@"', "bash", sys.executable, "infer.py", "--target", str(target),
            "--drafter", str(drafter), "--dtype", "float32", "--prompt", "hello", "--length", "3", "--json"]
    done = subprocess.run(argv, cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 0
    reports = [json.loads(line) for line in done.stdout.splitlines()]  # JSON only: no note among them
    assert [r["generator"] for r in reports] == ["target", "speculative", "ngram", "drafter"]


def test_a_length_that_leaves_no_room_for_the_conversation_says_so_once(tmp_path):
    """Issue 25: /length near the context emptied the conversation at every turn without saying why."""
    write_tiny_model(tmp_path / "short", seed=0, context=40)
    child = spawn((tmp_path / "short", tmp_path / "short"), "--length", "30", "--cache")
    send(child, "w1 w2")
    out = send(child, "w3 w4")
    assert "dropped the 1 oldest turn" in out
    assert "no earlier turn fits beside an answer of /length 30 in the context of 40 tokens" in out
    out = send(child, "w5 w6")
    assert "dropped the 1 oldest turn" in out and "no earlier turn fits" not in out  # once, not at every turn
    send(child, "/length 2")
    out = send(child, "w7 w8")
    out = send(child, "w9 w10")
    assert "dropped" not in out  # a short answer keeps the conversation
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_ctrl_c_while_the_models_load_is_one_line(monkeypatch):
    """Before the chat's own handling starts (a first start's build, a download): typer alone would exit 130
    without a word. In-process, so the interrupt falls exactly inside the load."""
    from typer.testing import CliRunner

    sys.path.insert(0, str(ROOT))
    import infer
    from utils.models import model_loader

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_loader, "load_model", interrupted)
    done = CliRunner().invoke(infer.app, ["--prompt", "hi", "--device", "cpu"])
    assert done.exit_code == 130
    assert done.stderr.strip().endswith("interrupted") and "Traceback" not in done.stderr


def test_a_ctrl_c_a_finaliser_swallows_during_the_load_still_stops_the_start(monkeypatch):
    """A sweep: Ctrl-C landing in a finaliser while the models loaded (the regex module's `__del__`) was printed as
    "Exception ignored … KeyboardInterrupt" and dropped by Python; the chat then started and answered, status 0."""
    from typer.testing import CliRunner

    sys.path.insert(0, str(ROOT))
    import infer
    from utils.models import model_loader

    def swallowed(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # delivered here, at once, to the main thread
            time.sleep(5)
        except KeyboardInterrupt:
            pass  # as a finaliser's caller does
        return None, None

    monkeypatch.setattr(model_loader, "load_model", swallowed)
    done = CliRunner().invoke(infer.app, ["--prompt", "hi", "--device", "cpu", "--generators", "target"])
    assert done.exit_code == 130
    assert done.stderr.strip().endswith("interrupted") and "Traceback" not in done.stderr


def test_sigterm_during_the_load_says_terminated_off_the_line_it_cut(monkeypatch):
    """A sweep: SIGTERM and SIGHUP left at once (status 143, 129) without a word, the last line (an answer streamed
    to stderr, "preparing … (one time only)…") unterminated; Ctrl-C said "interrupted" on a line of its own."""
    from typer.testing import CliRunner

    sys.path.insert(0, str(ROOT))
    import infer
    from utils.models import model_loader

    def terminated(*args, **kwargs):
        print("preparing a model (one time only)…", end="", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the load")

    monkeypatch.setattr(model_loader, "load_model", terminated)
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGTERM", "SIGHUP")}
    try:
        done = CliRunner().invoke(infer.app, ["--prompt", "hi", "--device", "cpu", "--generators", "target"])
    finally:
        for name, handler in handlers.items():
            signal.signal(getattr(signal, name), handler)
    assert done.exit_code == 128 + signal.SIGTERM
    assert done.stderr.endswith("(one time only)…\nterminated\n"), done.stderr


def test_the_chat_loop_names_each_way_a_line_ends_and_goes_on(monkeypatch):
    """The REPL in process, with a scripted terminal: what a line raised decides its one message, and only the end
    of input or a Ctrl-C at the prompt (not the one that stopped an answer) ends the chat."""
    import builtins
    import contextlib
    import io

    monkeypatch.syspath_prepend(str(ROOT))
    import infer
    from utils.chat import interrupts
    from utils.chat.commands import CommandError

    monkeypatch.setattr(infer, "setup_line_editing", lambda: None)  # no history file of the user's touched
    monkeypatch.setattr(interrupts, "take_ctrl_c", lambda: None)
    monkeypatch.setattr(interrupts, "at_prompt", lambda: None)
    monkeypatch.setattr(interrupts, "interruptible", lambda **kwargs: contextlib.nullcontext())
    bursts = []
    monkeypatch.setattr(interrupts, "same_burst", lambda: bursts.pop(0))

    class Chat:
        out, running, answering, interrupt_note = io.StringIO(), True, False, ""

        def __init__(self):
            self.said, self.errors = [], []
            self.say, self.error = self.said.append, self.errors.append

        def handle(self, line):
            self.answering = line == "answer"
            if line in ("answer", "/file fifo"):  # a Ctrl-C during an answer, or during a command
                self.interrupt_note = "; the conversation goes on without this prompt" if self.answering else ""
                raise KeyboardInterrupt
            if line == "/length 0":
                raise CommandError("/length: N must be an integer >= 1")
            if line == "piped":
                raise BrokenPipeError(32, "Broken pipe")
            raise ValueError("x" * 1000)

    def typed(*lines):
        script = iter(lines)

        def read(prompt):
            line = next(script)
            if isinstance(line, BaseException):
                raise line
            return line
        monkeypatch.setattr(builtins, "input", read)

    chat = Chat()
    bad_byte = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    typed("answer", KeyboardInterrupt(), "/file fifo", bad_byte, "/length 0", "boom", EOFError(), "never read")
    bursts.append(True)  # the press right after the one that stopped the answer: absorbed, the chat goes on
    infer.repl(chat)
    assert chat.errors == ["generation interrupted; the conversation goes on without this prompt", "interrupted",
                           "the input is not valid UTF-8", "/length: N must be an integer >= 1",
                           f"error: ValueError: {'x' * 300}…"]  # one line, not the 1000 characters
    assert not bursts

    chat = Chat()
    typed(KeyboardInterrupt(), "never read")
    bursts.append(False)  # a Ctrl-C at the prompt of its own: the user leaves
    infer.repl(chat)
    assert chat.errors == []

    typed("piped", "never read")
    with pytest.raises(BrokenPipeError):  # stdout's reader left: run() leaves quietly, no error line to write
        infer.repl(Chat())
    typed(RuntimeError("something else"))
    with pytest.raises(RuntimeError, match="something else"):  # with a stdin, a RuntimeError is no end of input
        infer.repl(Chat())
    chat = Chat()
    typed(RuntimeError("input(): lost sys.stdin"), "never read")
    monkeypatch.setattr(sys, "stdin", None)  # `exec 0<&-`: nothing to read, the end of input
    infer.repl(chat)
    monkeypatch.undo()  # sys.stdin back
