"""Interactive speculative-decoding chat: every enabled generator answers each prompt, side by side.

    python infer.py                      # the embedded Qwen2.5-Coder 1.5B target + 0.5B drafter
    python infer.py --prompt "..." --json
"""

from __future__ import annotations

import codecs
import errno
import functools
import gc
import os
import re
import sys
from types import SimpleNamespace
from typing import Optional

import typer

app = typer.Typer(add_completion=False, help=__doc__, rich_markup_mode=None)

# the end of --help: every variable the program reads (tests/test_cli.py checks the list against the code)
ENVIRONMENT = ("Environment: SPECDEC_CACHE_DIR (the cache folder, see README); SPECDEC_QKERNELS=off (torch's int4 and "
               "bfloat16 kernels instead of ours); SPECDEC_QKERNELS_ARCH (the kernel build's -march, e.g. "
               "-march=x86-64-v3 for an AVX2-only CPU); SPECDEC_QKERNELS_DIR (one kernel build shared by several "
               "cache folders); SPECDEC_QKERNELS_VERBOSE=1 (the compiler's output); SPECDEC_AMX=off (no AMX tiles); "
               "SPECDEC_TRACEBACK=1 (a traceback where a model fails to run); NO_COLOR, FORCE_COLOR.")


def fail(message: str, code: int = 1) -> None:
    from utils.printing import paint

    print(paint(message, "red", sys.stderr), file=sys.stderr, flush=True)
    raise typer.Exit(code)


def interrupted_in_one_line(command):
    """Ctrl-C while the models load (a first start's build, a download): one line and status 130, as during an
    answer; typer alone would exit 130 without a word."""
    @functools.wraps(command)
    def run_command(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            print(file=sys.stderr)  # off the line of a progress bar
            fail("interrupted", 130)
        except Terminated as signalled:  # as Ctrl-C, off the line it cut (an answer streamed, a progress line)
            try:
                print(file=sys.stderr)
                fail("terminated", signalled.code)
            except OSError:  # SIGHUP: the terminal may be gone
                raise typer.Exit(signalled.code) from None

    return run_command


class Terminated(SystemExit):
    """SIGTERM or SIGHUP: raised in the main thread, so that `finally` blocks run (a half-written conversion is
    removed, a kernel build's compilers stopped) and atexit saves the line history."""


@app.command(epilog=ENVIRONMENT)
@interrupted_in_one_line
def main(
    target: str = typer.Option("qwen2.5-coder-1.5b-instruct", help="target: embedded name, Hugging Face id, folder, .gguf file, or a GGUF file on the hub (owner/repo:QUANT, owner/repo/FILE.gguf; a split model by its first part)"),
    drafter: str = typer.Option("qwen2.5-coder-0.5b-instruct", help="drafter: same forms as --target"),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps"),
    dtype: str = typer.Option("auto", help="auto, native, float32, bfloat16 or float16 (auto: GGUF models on CPU run native, at the file's own precision; see README)"),
    kernels: str = typer.Option("auto", help="native mode: auto (measured on this CPU, cached), gguf (our integer kernels), gguf8 (Q2_K to Q6_K, IQ4_XS, Q4_1 and Q8_0 with 8 rows interleaved, else gguf), int4, bf16 or f32 (the exactness reference); a layer the forced kernel cannot run goes to gguf, else bf16, with a note"),
    int4_drafter: bool = typer.Option(True, "--int4-drafter/--no-int4-drafter", help="native mode: the drafter's non-4-bit tensors re-quantised to int4 (cheaper drafts; the target still checks every token)"),
    device_map: Optional[str] = typer.Option(None, help="passed to accelerate, e.g. auto (several GPUs, offloading)"),
    onednn: bool = typer.Option(True, "--onednn/--no-onednn", help="float32 on CPU: oneDNN linear layers with packed weights (faster; see README on memory)"),
    int8_drafter: bool = typer.Option(True, "--int8-drafter/--no-int8-drafter", help="float32 on CPU: drafter's linear layers in dynamic int8 (cheaper drafts; the target still checks every token)"),
    gamma: str = typer.Option("auto", help="most drafts per speculative or NASD round (the draft stop may end one sooner): an integer >= 1, or auto (6; with --cache, greedy and a confidence rule of P >= 0.9, speculative decoding's cap from this machine's timed passes, see README)"),
    draft_stop: Optional[str] = typer.Option(None, help="speculative: how many of up to gamma drafts a round proposes: 'auto' (the default: 'confidence 0.9' with --cache, 'confidence 0.6' without (0.75 sampling)), 'fixed', 'adaptive', 'confidence [P]', 'entropy [BOUND]', 'learned [HEAD_FILE]' (see README)"),
    adaptive: bool = typer.Option(False, "--adaptive", help="speculative: --draft-stop adaptive (draft length follows acceptance)"),
    confidence: float = typer.Option(0.0, help="speculative: --draft-stop 'confidence P', P in [0, 1) (0: off)"),
    length: int = typer.Option(35, min=1, help="tokens to generate per answer"),
    processor: str = typer.Option("greedy", help="'greedy [T]', 'multinomial T', 'topk T K', 'nucleus T P', 'topknucleus T K P'"),
    seed: int = typer.Option(42, help="random seed each generator starts from"),
    cache: bool = typer.Option(False, "--cache/--no-cache", help="KV cache (off by default; unstable across models)"),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="chat template and history (default: on when the tokenizer has a template)"),
    debug: bool = typer.Option(False, "--debug", help="colour each speculative round"),
    kv_budget: int = typer.Option(0, min=0, help="attend to (and, with the cache on, keep) at most N positions: 4 "
                                  "attention sinks and the N-4 most recent, StreamingLLM-style (0: off; lossy against "
                                  "full attention, and every generator follows it, so SD still equals AR)"),
    kv_policy: str = typer.Option("streaming", help="with --kv-budget: which positions besides the recent window are "
                                  "kept: 'streaming' (the 4 first), 'h2o' (each layer's most attended so far) or "
                                  "'snapkv' (its most attended prompt positions, chosen after the prompt is read); "
                                  "h2o and snapkv need --cache"),
    draft_vocab: Optional[int] = typer.Option(None, min=0, help="speculative: the drafter's head computes only the N "
                                              "most frequent tokens (a ranking shipped for its tokenizer) and the "
                                              "conversation's: cheaper drafts, lossless (the drafter alone answers "
                                              "with it too; 0: every token; default: the size measured best, shown "
                                              "by /help)"),
    drafter_window: str = typer.Option("auto", help="speculative: the drafter reads and keeps 4 sinks and its N-4 "
                                       "latest positions (TriForce/MagicDec; 0: everything; auto: with the cache off, "
                                       "where each drafter pass reads its whole window, the size /help shows, "
                                       "everything with it on): "
                                       "a long prompt's drafter prefill shrinks to N, and the target still checks "
                                       "every draft"),
    ngram_cache: Optional[str] = typer.Option(None, help="NASD: load the n-gram storage from this file if it exists, "
                                              "keep it across prompts and save it after every answer"),
    ngram_prior: bool = typer.Option(True, "--ngram-prior/--no-ngram-prior", help="NASD also drafts from the "
                                     "n-gram prior shipped for the target's tokenizer (its typical answers) where "
                                     "the conversation knows no context; lossless"),
    generators: str = typer.Option("target,speculative,ngram,drafter", help="the generators enabled at the start, "
                                   "comma-separated (each answers every prompt; toggled later by /target, "
                                   "/speculative, /ngram, /drafter)"),
    prompt: Optional[str] = typer.Option(None, help="answer this prompt once, print the report and exit"),
    prompt_file: Optional[str] = typer.Option(None, help="as --prompt, with a UTF-8 text file's content"),
    json_output: bool = typer.Option(False, "--json", help="with --prompt: one JSON object per generator on stdout"),
):
    # the phases: the command line checked, the pair loaded and set up, a session started, then served
    options = SimpleNamespace(**locals())  # the command line as given, read by each phase below
    exit_on_termination_signals()
    options.prompt = checked_prompt(options)
    settings = checked_settings(options)
    # One answer that no drafter-model generator gives: the drafter is not loaded (the chat loads it, since
    # /speculative and /drafter may turn them on later)
    skip_drafter = options.prompt is not None and not (settings.enabled["speculative"] or settings.enabled["drafter"])
    target_model, tokenizer, drafter_model, drafter_tokenizer = load_pair(options, skip_drafter)
    translated, inline, below = configure_pair(options, settings, target_model, tokenizer, drafter_model,
                                               drafter_tokenizer, skip_drafter)
    session, prior_line = started_session(options, settings, target_model, drafter_model, tokenizer,
                                          drafter_tokenizer, translated, skip_drafter)
    line = " · ".join([startup_line(options.target, None if skip_drafter else options.drafter, target_model,
                                    drafter_model, settings.chat, options.int4_drafter),
                       *([prior_line] if prior_line else []), *inline])
    serve(session, options, "\n".join([line, *below]))


def checked_prompt(o) -> str | None:
    """`--prompt` or `--prompt-file`'s text, checked before anything loads: there may be nothing to answer."""
    from utils.chat.session import is_utf8

    prompt = o.prompt
    if o.prompt_file is not None:
        from utils.chat.prompt_file import PromptFileError, read_prompt_file

        if prompt is not None:
            fail("--prompt and --prompt-file: give one of them", 2)
        try:
            prompt = read_prompt_file(o.prompt_file)
        except PromptFileError as error:
            fail(f"--prompt-file: {error}", 2)
    if o.json_output and prompt is None:
        fail("--json needs --prompt or --prompt-file", 2)
    if prompt is not None and not prompt.strip():
        fail("--prompt is empty", 2)
    if prompt is not None and not is_utf8(prompt):
        fail("--prompt is not valid UTF-8", 2)
    return prompt


def checked_settings(o):
    """The chat's `Settings` from the options, each bad value a usage error named by its option (status 2) before
    minutes of loading; `o.ngram_cache` expanded."""
    from utils.caching import KV_POLICIES
    from utils.chat.commands import SEEDS, probability_below_one
    from utils.chat.settings import (GAMMA_RULE, Settings, draft_stop_from_flags, parse_gamma, parse_generators,
                                     parse_processor, parse_window, shown)
    from utils.model_runner import check_window
    from utils.models.model_loader import unknown_name
    from utils.paths import unwritable

    if not SEEDS[0] <= o.seed <= SEEDS[1]:
        fail(f"--seed must be an integer from -2**63 to 2**64-1 (what torch accepts), got {o.seed}", 2)
    # the loader checks these too, later; here they are usage errors like the rest, named by their option
    for option in ("device", "dtype", "kernels"):
        if why := unknown_name(option, getattr(o, option)):
            fail(f"--{option}: {why}", 2)
    for option in ("target", "drafter"):
        if not getattr(o, option).strip():
            fail(f"--{option}: give an embedded name, a Hugging Face id, a folder or a .gguf file", 2)
    try:
        window = parse_window(o.drafter_window)
        check_window(window or 0)
    except ValueError as error:
        fail(f"--drafter-window: {error}", 2)
    try:
        gamma = parse_gamma(o.gamma)
    except ValueError:
        fail(f"--gamma: must be {GAMMA_RULE}, got {shown(o.gamma)}", 2)
    try:
        settings = Settings(gamma=gamma, length=o.length, processor=parse_processor(o.processor.split()), seed=o.seed,
                            use_cache=o.cache, debug=o.debug, drafter_window=window)
    except ValueError as error:
        fail(f"--processor: {error}", 2)
    try:
        probability_below_one(str(o.confidence))  # as /confidence takes it
    except ValueError:
        fail(f"--confidence: P must be a number in [0, 1), got {o.confidence:g}", 2)
    try:
        settings.draft_stop = draft_stop_from_flags(o.draft_stop, o.adaptive, o.confidence)
    except ValueError as error:
        fail(f"--draft-stop: {error}", 2)
    if o.kv_policy not in KV_POLICIES:
        fail(f"--kv-policy: unknown policy {o.kv_policy!r}; use one of {', '.join(KV_POLICIES)}", 2)
    if o.kv_policy != "streaming" and not (o.kv_budget and o.cache):
        fail(f"--kv-policy {o.kv_policy}: it evicts from a bounded KV cache: give --kv-budget N and --cache", 2)
    try:
        settings.enabled = parse_generators(o.generators)
    except ValueError as error:
        fail(f"--generators: {error}", 2)
    if o.ngram_cache is not None:
        o.ngram_cache = os.path.expanduser(o.ngram_cache)
        if problem := unwritable(o.ngram_cache):
            fail(f"--ngram-cache: {problem}", 2)  # not after every answer: the first would have been lost
    return settings


def load_pair(o, skip_drafter: bool) -> tuple:
    """(target, its tokenizer, drafter, its tokenizer); the drafter is the target where both name one model or
    no generator needs it. A model that does not load: one line."""
    from utils.chat.interrupts import check as check_interrupt, interruptible
    from utils.models.model_loader import ModelLoadError, load_model, prune_cache, read_ahead, same_model

    try:
        # remembered: a Ctrl-C that lands in a finaliser during the load (the regex module's, seen) is printed as
        # "Exception ignored" and dropped by Python, and the chat would have started as if nothing were asked
        with interruptible():
            read_ahead([o.target] if skip_drafter else [o.target, o.drafter], o.device, o.dtype, o.device_map)
            target, tokenizer = load_model(o.target, o.device, o.dtype, o.device_map, onednn=o.onednn,
                                           kernels=o.kernels)
            drafter, drafter_tokenizer = (
                (target, tokenizer) if same_model(o.drafter, o.target) or skip_drafter
                else load_model(o.drafter, o.device, o.dtype, o.device_map, onednn=o.onednn, int8=o.int8_drafter,
                                kernels=o.kernels, int4_drafter=o.int4_drafter)
            )
            check_interrupt()
    except ModelLoadError as error:
        fail(str(error))
    prune_cache()  # after both loads: what they use is marked
    return target, tokenizer, drafter, drafter_tokenizer


def configure_pair(o, settings, target_model, tokenizer, drafter_model, drafter_tokenizer, skip_drafter: bool):
    """What the loaded pair needs before a session: a KV budget, the drafter's window and head shortlist, chat
    mode. Returns the drafter's tokenizer where it drafts translated (else None), and the start line's notes: those
    on its last line, those on lines below it."""
    from utils.caching import SINKS
    from utils.model_runner import check_window
    from utils.models.draft_vocab import shortlisted, use_draft_vocab
    from utils.models.model_loader import ModelLoadError, check_vocab_compatible
    from utils.models.native_tree import NativeCausalLM
    from utils.models.rowwise_attention import describe_budget, use_kv_budget
    from utils.printing import one_line

    try:
        check_vocab_compatible(target_model, tokenizer, drafter_model, drafter_tokenizer)
        translated, mismatch = None, None
    except ModelLoadError as error:  # another vocabulary: the drafter drafts in its own tokens, translated
        translated, mismatch = drafter_tokenizer, error
    if o.kv_budget:
        models = [("the target", target_model)] + [("the drafter", drafter_model)] * (drafter_model is not target_model)
        for role, model in models:
            try:
                use_kv_budget(model, o.kv_budget, policy=o.kv_policy)
            except ValueError as error:
                fail(f"--kv-budget: {error} ({role})", 2)
    window = settings.drafter_window
    try:
        check_window(window or 0, None if skip_drafter else drafter_model)
    except ValueError as error:
        fail(f"--drafter-window: {error}", 2)
    if o.draft_vocab is not None:
        settings.draft_vocab = o.draft_vocab
    if drafter_model is target_model:
        settings.draft_vocab, vocab_line = 0, ""  # the target's head stays whole: /help says "all"
    else:
        vocab_line = use_draft_vocab(drafter_model, drafter_tokenizer, settings.draft_vocab)
        if not shortlisted(drafter_model):  # no ranking, a head it cannot cut, N past the vocabulary: /help says "all"
            settings.draft_vocab = 0
    settings.chat = bool(tokenizer.chat_template) if o.chat is None else o.chat
    if settings.chat and not tokenizer.chat_template:
        fail("--chat: this tokenizer has no chat template", 2)
    inline, below = [], []
    if vocab_line:
        inline.append(f"drafter {vocab_line}")
    if o.kv_budget:
        inline.append(f"KV budget {o.kv_budget}, {o.kv_policy}: {describe_budget(target_model)}")
    if window and not skip_drafter:
        inline.append(f"drafter window {window} ({SINKS} sinks + the {window - SINKS} most recent positions)")
    if o.kernels != "auto" and not any(isinstance(m, NativeCausalLM) for m in (target_model, drafter_model)):
        below.append(f"--kernels {o.kernels} has no effect: no model runs GGUF blocks natively (a GGUF model on the "
                     "CPU)")
    if mismatch is not None:
        below.append(f"vocabularies differ ({one_line(mismatch).split(':')[0]}): the drafter drafts in its own "
                     "tokens, translated to the target's through text and kept only where they equal the target's "
                     "own choice (lossless; its draft length follows acceptance with auto or adaptive, else fixed)")
    return translated, inline, below


def started_session(o, settings, target_model, drafter_model, tokenizer, drafter_tokenizer, translated,
                    skip_drafter: bool):
    """The chat's session over the pair, its draft stop built and its models warmed up; returns it and the line
    of NASD's prior ("" where none is loaded)."""
    from utils.chat.session import Session
    from utils.printing import one_line

    session = Session(target_model, drafter_model, tokenizer, settings, json_mode=o.json_output,
                      drafter_tokenizer=translated, drafter_own_tokenizer=drafter_tokenizer)
    if o.cache and (refusal := session.cache_refusal()):
        fail(f"--cache: {refusal}; run it without --cache", 2)
    try:
        if not skip_drafter:  # no speculative round will run: a learned head has no drafter to be checked against
            session.draft_stop()  # built once and kept: a learned rule's head, checked against this drafter
    except ValueError as error:
        fail(f"--draft-stop: {error}", 2)
    try:
        session.warm_up()
    except Exception as error:  # noqa: BLE001 - a model that loads but cannot run (an architecture's own code)
        if os.environ.get("SPECDEC_TRACEBACK"):
            raise
        fail(f"the models load but cannot run: {type(error).__name__}: {one_line(error)} (SPECDEC_TRACEBACK=1 "
             "shows where)")
    settings.ngram_prior = o.ngram_prior
    return session, session.load_prior() if o.ngram_prior else ""  # else loaded by /ngram_prior, if ever


def serve(session, o, line: str) -> None:
    """Prints the start line, then answers `--prompt` and exits, or runs the chat; an output that fails (a reader
    gone, a full disk, a terminal gone) ends it in one line."""
    from utils.chat.session import CACHE_WARNING
    from utils.printing import paint

    log = sys.stderr if o.json_output else sys.stdout
    try:
        print(paint(line, "green", log), file=log, flush=True)
        if o.cache:
            session.error(CACHE_WARNING)
        if o.ngram_cache is not None:
            session.use_ngram_cache(o.ngram_cache)
        if o.prompt is not None:
            answer_once(session, o.prompt, o.json_output)
        repl(session)
    except BrokenPipeError:
        leave_quietly()
    except OSError as error:
        if not output_failed(error):
            raise
        unplug_stdout()
        # /dev/full, a disk that filled; EIO and EBADF also where the terminal itself went away
        fail(f"{'cannot write the output' if error.errno in OUTPUT_FULL else 'the terminal failed'}: "
             f"{error.strerror or error}")


def answer_once(session, prompt: str, json_output: bool) -> None:
    from utils.chat.commands import CommandError
    from utils.chat.interrupts import interruptible
    from utils.chat.report import report_json
    from utils.printing import one_line

    try:
        with interruptible():
            reports = session.answer(prompt.strip())  # always a prompt, even one that starts with "/"
    except CommandError as error:
        fail(one_line(error))
    except KeyboardInterrupt:
        print(file=session.out, flush=True)  # off the line of the answer streamed so far, as the chat does
        if json_output:  # the answers finished before it are answers, as a chat keeps them
            for report in session.finished:
                print(report_json(report), flush=True)
        fail("interrupted", 130)
    except BrokenPipeError:
        raise
    except Exception as error:  # one line, never a traceback
        if isinstance(error, OSError) and output_failed(error):  # the answer could not be written: main says so
            raise
        fail(f"error: {type(error).__name__}: {one_line(error)}")
    if json_output:
        for report in reports:
            print(report_json(report), flush=True)
    raise typer.Exit(1 if any(r.error for r in reports) else 0)


def leave_quietly() -> None:
    """stdout's reader has gone (`… | head -1`): nothing more can be shown, so leave without a word, with the
    status of a tool that SIGPIPE ended, as `yes | head -1` does."""
    import signal

    unplug_stdout()
    raise typer.Exit(128 + signal.SIGPIPE)


OUTPUT_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def output_failed(error: OSError) -> bool:
    """Whether `error` came from the terminal or stdout (no file named): what the chat shows can no longer be
    written, or its input read."""
    return error.errno in (*OUTPUT_FULL, errno.EIO, errno.EBADF) and error.filename is None


def unplug_stdout() -> None:
    """stdout then points at /dev/null, so that the interpreter's last flush of what is still buffered cannot fail
    again (a second error, printed at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def exit_on_termination_signals() -> None:
    """SIGTERM and SIGHUP leave as Ctrl-C does: `finally` blocks remove a half-written conversion, and atexit
    saves the line history. (SIGKILL cannot be caught: the next start sweeps what it leaves.)"""
    import signal

    def leave(signum, frame):
        raise Terminated(128 + signum)

    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), leave)


def startup_line(target: str, drafter: str | None, target_model, drafter_model, chat: bool, int4_drafter: bool) -> str:
    """Which models, at which precision and kernels, on which CPU: every figure the chat prints depends on it.
    `drafter` None: not loaded."""
    from utils.models.cpu_kernels import int8_layers
    from utils.models import qkernels
    from utils.models.kernel_choice import describe_cpu
    from utils.models.model_loader import precision_summary

    drafter_precision = precision_summary(drafter_model)
    drafter_note = " · int8 linear layers except the MLP down projection" if int8_layers(drafter_model) else ""
    if int4_drafter and drafter_precision.startswith("native") and drafter_model is not target_model:
        drafter_note = " · re-quantised to 4 bits where the file is not (a lossy drafter; the target checks every token)"
    device = f"{target_model.device}" + (f" · {describe_cpu()} · {qkernels.describe()}"
                                         if target_model.device.type == "cpu" else "")
    drafter_line = (f"drafter {drafter} · {drafter_precision}{drafter_note}" if drafter is not None
                    else "drafter not loaded: no generator of this answer uses it")
    return (f"target  {target} · {precision_summary(target_model)}\n"
            f"{drafter_line}\n"
            f"device  {device} · chat {'on' if chat else 'off'}")


def repl(session) -> None:
    from utils.chat.commands import CommandError
    from utils.chat.interrupts import at_prompt, interruptible, same_burst, take_ctrl_c
    from utils.printing import one_line

    take_ctrl_c()
    setup_line_editing()
    session.say("Type a prompt, /help for commands, /quit (or Ctrl-D) to leave.")
    while session.running:
        try:
            at_prompt()
            line = input("> ")
        except KeyboardInterrupt:
            print(file=session.out)
            if same_burst():  # the double press that stopped the last answer: the chat goes on
                continue
            break
        except EOFError:
            print(file=session.out)
            break
        except RuntimeError:
            if sys.stdin is not None:
                raise
            # stdin was closed before we started (`exec 0<&-`): Python then has no sys.stdin and input() raises
            # "lost sys.stdin". There is nothing to read: the end of input.
            print(file=session.out)
            break
        except UnicodeDecodeError:
            session.error("the input is not valid UTF-8")
            continue
        try:
            with interruptible(absorb_until_prompt=True):
                session.handle(line)
        except KeyboardInterrupt:
            print(file=session.out)
            # not answering: /file reading a FIFO
            session.error("generation interrupted" + session.interrupt_note if session.answering else "interrupted")
        except CommandError as error:
            session.error(one_line(error))  # at most 300 characters: a 3000-digit argument is not echoed whole
        except BrokenPipeError:
            raise
        except Exception as error:  # the session goes on whatever one prompt did
            session.error(f"error: {type(error).__name__}: {one_line(error)}")


def setup_line_editing() -> None:
    """Arrow keys and a history kept across sessions, through readline where Python has it."""
    try:
        import atexit
        import readline
    except ImportError:
        return
    path = os.path.join(os.path.expanduser("~"), ".specdec_history")
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    atexit.register(lambda: _save_history(readline, path))


def _save_history(readline, path: str) -> None:
    try:
        readline.write_history_file(path)
    except OSError:
        pass


def run() -> None:
    """The command line, with typer's usage errors (a bad or missing option value) in one line like every other
    error, instead of its four (usage, hint, blank, error); its exit codes as in its standalone mode."""
    usage_errors = tuple(kind for kind in (getattr(typer, "TyperException", None), click_exception()) if kind)
    if not writable(1, sys.stdout):  # started with stdout closed (`>&-`): every answer would be lost
        print("the standard output is closed: nothing could be shown (open it, or send it to /dev/null)",
              file=sys.stderr)
        sys.exit(2)
    stderr_to_null_if_closed()
    lenient_streams()
    ignore_invalid_thread_count()
    bars_to_terminal_only()
    try:
        code = app(standalone_mode=False)
    except typer.Abort:  # EOF or Ctrl-C where click turns them into an abort, as its standalone mode says
        print("Aborted!", file=sys.stderr)
        code = 1
    except usage_errors as error:
        if not hasattr(error, "format_message"):
            raise
        message = error.format_message()
        param = getattr(error, "param", None)
        if param is not None and getattr(param, "opts", None):
            message = f"{param.opts[0]}: " + message.replace(f"Invalid value for '{param.opts[0]}': ", "")
        try:
            fail(f"{' '.join(message.split())} (--help lists the options)", getattr(error, "exit_code", 2))
        except typer.Exit as done:
            code = done.exit_code
    # The interpreter's teardown collects garbage as it clears each module, visiting every object the models,
    # tokenizers and n-gram storage hold: 1.5 s of a start that answers one prompt on the Zen 3 of
    # benchmarks/RESULTS.md. Frozen, they are not visited (0.3 s); the process's end frees their memory anyway.
    gc.freeze()
    sys.exit(code if isinstance(code, int) else 0)


def writable(fd: int, stream) -> bool:
    """Whether `stream` writes to an open, writable descriptor `fd`. Started with it closed (`>&-`), Python leaves
    the stream None; through a launcher script (pyenv's shim), the script's own file, opened for reading, took
    the descriptor's number, and every write fails (EBADF)."""
    if stream is None:
        return False
    if os.name != "posix":
        return True
    import fcntl

    try:
        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
    except OSError:
        return False


def stderr_to_null_if_closed() -> None:
    """Started with stderr closed (`2>&-`) through pyenv's shim, the start line's write failed (EBADF), which was
    taken for the terminal's failure, and the answers on stdout were lost. Notes go nowhere instead (without the
    shim too, where Python has no sys.stderr), on descriptor 2 itself, so that no file opened later lands there
    and receives them."""
    if writable(2, sys.stderr):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    if null != 2:
        os.dup2(null, 2)
        os.close(null)
    sys.stderr = open(2, "w", closefd=False)


def lenient_streams() -> None:
    """Where the terminal's encoding is not UTF-8 (PYTHONIOENCODING=ascii or latin-1), a character it lacks (the
    start line's "·", a heading's "──", an answer's emoji) is shown as "?" instead of ending the chat with a
    UnicodeEncodeError, and typed bytes it cannot decode reach the prompt check ("not valid UTF-8") as they do from
    a UTF-8 terminal."""
    for stream, errors in ((sys.stdout, "replace"), (sys.stderr, "backslashreplace"), (sys.stdin, "surrogateescape")):
        encoding = getattr(stream, "encoding", None)
        if encoding and hasattr(stream, "reconfigure") and codecs.lookup(encoding).name != "utf-8":
            stream.reconfigure(errors=errors)


def bars_to_terminal_only() -> None:
    """Ours follow `bars_shown`; transformers' "Converting and de-quantizing GGUF tensors" bar (--dtype float32 on
    a .gguf) is a tqdm of its own, out of reach of its progress-bar switch, whose carriage returns filled a log or a
    pipe. tqdm reads TQDM_DISABLE once, as it is imported: before anything imports it, unless the user set it."""
    from utils.printing import bars_shown

    if not bars_shown():
        os.environ.setdefault("TQDM_DISABLE", "1")


def ignore_invalid_thread_count() -> None:
    """libgomp reads OMP_NUM_THREADS as torch loads and, for a value that is no list of positive integers ("abc",
    "0", "1.5"), prints its own "libgomp: Invalid value …" and uses every core. One line of ours says so instead,
    before torch is imported (the start line then shows the threads used)."""
    value = os.environ.get("OMP_NUM_THREADS")
    if value is None or all(re.fullmatch(r"\s*\+?0*[1-9][0-9]*\s*", part, re.ASCII) and int(part) < 2**63
                            for part in value.split(",")):  # (libgomp: ASCII blanks, a signed long)
        return
    del os.environ["OMP_NUM_THREADS"]
    print(f"note: OMP_NUM_THREADS={value!r} is not a number of threads (an integer >= 1, or a list of them): "
          "ignored", file=sys.stderr)


def click_exception():
    """click's base exception where typer runs on click (older typer); newer typer carries its own copy."""
    try:
        import click
    except ImportError:
        return None
    return click.ClickException


if __name__ == "__main__":
    run()
