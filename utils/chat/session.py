"""One chat session: runs every enabled generator on a prompt, streams its text and reports honest figures."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ngram_assisted import NGramStorage, OneLevelNGramStorage, nasd_run
from sampling import LoopSettings, autoregressive_run, speculative_run
from utils.chat.commands import CommandError, help_text, parse_command
from utils.model_runner import context_limit
from utils.printing import format_round, one_line, paint
from utils.chat.settings import GENERATOR_TITLES, GENERATORS, Settings

CACHE_WARNING = (
    "Warning: the KV cache is unstable across models: it may raise errors or change the output. "
    "Use it with caution."
)
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")  # chat templates' turn ends


@dataclass
class Report:
    generator: str
    text: str
    token_ids: list[int]
    tokens_generated: int
    seconds: float
    tokens_per_s: float
    acceptance_rate: float | None
    speedup: float | None  # over the target's autoregressive decoding of the same prompt
    target_forwards: int
    drafter_forwards: int
    error: str | None = None  # "ExceptionType: message"


class Session:
    def __init__(self, target, drafter, tokenizer, settings: Settings, json_mode: bool = False):
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.settings = settings
        self.out = sys.stderr if json_mode else sys.stdout  # in JSON mode stdout carries only the JSON objects
        self.history: list[dict] = []
        self.running = True
        self.limit = context_limit(target)
        self.reset_storage()

    # -- messages -------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def error(self, text: str) -> None:
        print(paint(text, "red"), file=self.out, flush=True)

    def show_help(self) -> None:
        self.say("Type a prompt to have every enabled generator answer it (start it with // to send one that begins "
                 "with /), or a command:\n" + help_text(self.settings))

    def quit(self) -> None:
        self.running = False

    def clear_screen(self) -> None:
        print("\033[2J\033[H", end="", file=self.out, flush=True)

    # -- settings with side effects -------------------------------------------------------------------------
    def toggle_cache(self) -> None:
        self.settings.use_cache = not self.settings.use_cache
        self.say(f"cache: {'on' if self.settings.use_cache else 'off'}")
        if self.settings.use_cache:
            self.error(CACHE_WARNING)

    def toggle_chat(self) -> None:
        if not self.settings.chat and not self.tokenizer.chat_template:
            raise CommandError("this tokenizer has no chat template; chat mode stays off")
        self.settings.chat = not self.settings.chat
        self.say(f"chat: {'on' if self.settings.chat else 'off'}")

    def reset_conversation(self) -> None:
        self.history.clear()
        self.say("new conversation")

    def reset_storage(self) -> None:
        self.storage = self.make_storage(self.settings.ngram_kind, self.settings.ngram_n)

    def make_storage(self, kind: str, n: int):
        cls = NGramStorage if kind == "basic" else OneLevelNGramStorage
        return cls(n, self.target.config.vocab_size)

    # -- one line of input ----------------------------------------------------------------------------------
    def handle(self, line: str) -> list[Report]:
        """A REPL line: a command, or a prompt (`//` escapes a prompt that starts with `/`)."""
        line = line.strip()
        if not line:
            return []
        if line.startswith("//"):
            return self.answer(line[1:])
        if line.startswith("/"):
            command, values = parse_command(line)
            command.run(self, *values)
            return []
        return self.answer(line)

    def answer(self, prompt: str) -> list[Report]:
        if not is_utf8(prompt):
            raise CommandError("the input is not valid UTF-8")
        ids = self.encode(prompt)
        if self.limit is not None and len(ids) >= self.limit:
            raise CommandError(f"the prompt is {len(ids)} tokens long; the target's context is {self.limit} (try /reset)")
        if not any(self.settings.enabled.values()):
            raise CommandError("every generator is off; turn one on with /target, /speculative, /ngram or /drafter")
        reports, baseline = [], None
        stop = self.stop_tokens()  # once per prompt, outside the timed generations (it scans the vocabulary)
        for name in GENERATORS:
            if self.settings.enabled[name]:
                report = self.run_block(name, ids, stop, baseline)
                reports.append(report)
                if name == "target" and report.error is None:
                    baseline = report.tokens_per_s
        if self.settings.chat and self.tokenizer.chat_template:
            reply = next((r.text for r in reports if r.error is None and r.generator != "drafter"), reports[0].text)
            self.history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
        return reports

    def encode(self, prompt: str) -> list[int]:
        if self.settings.chat and self.tokenizer.chat_template:
            return chat_ids(self.tokenizer, prompt, self.history)
        return list(self.tokenizer(prompt)["input_ids"])

    def stop_tokens(self) -> list[int]:
        return stop_tokens(self.tokenizer, self.target, self.settings.chat)

    # -- one generator --------------------------------------------------------------------------------------
    def run_block(self, name: str, ids: list[int], stop: list[int], baseline: float | None) -> Report:
        self.say(paint(f"── {GENERATOR_TITLES[name]} ──", "cyan", attrs=["bold"]))
        stream = Stream(self.tokenizer, self.out, self.settings.debug and name in ("speculative", "ngram"))
        torch.manual_seed(self.settings.seed)
        try:
            synchronize(self.target.device)
            start = time.perf_counter()
            result = self.generate(name, ids, stop, stream.on_round)
            synchronize(self.target.device)
            seconds = time.perf_counter() - start
        except (ValueError, RuntimeError, IndexError) as error:
            stream.end()
            message = f"{type(error).__name__}: {one_line(error)}"
            self.error(f"{name} failed: {message}")
            return Report(name, "", [], 0, 0.0, 0.0, None, None, 0, 0, error=message)
        stream.end()
        count = len(result.tokens)
        tps = count / seconds if seconds > 0 else 0.0
        # Acceptance of nothing proposed is undefined, not 0%.
        acceptance = result.acceptance_rate if name in ("speculative", "ngram") and result.drafted else None
        speedup = tps / baseline if baseline else (1.0 if name == "target" else None)
        # The drafter's autoregressive run drives the drafter through the loop's "target" slot.
        forwards = (0, result.target_calls) if name == "drafter" else (result.target_calls, result.drafter_calls)
        report = Report(name, self.tokenizer.decode(result.tokens, skip_special_tokens=True), result.tokens, count,
                        seconds, tps, acceptance, speedup, *forwards)
        self.say(paint(stats_line(report), "yellow"))
        if self.stopped_by_context(name, len(ids), result.tokens, stop):
            self.say(paint(f"(the answer stopped because the context of {self.limit_of(name)} tokens is full; "
                           "/reset starts a new conversation)", "yellow"))
        return report

    def limit_of(self, name: str) -> int | None:
        return context_limit(self.drafter if name == "drafter" else self.target)

    def stopped_by_context(self, name: str, prompt_len: int, tokens: list[int], stop: list[int]) -> bool:
        limit = self.limit_of(name)
        ended = bool(tokens) and tokens[-1] in stop
        # The loop's budget ends a sequence one past the context (its last token is never fed back).
        return limit is not None and not ended and len(tokens) < self.settings.length and prompt_len + len(tokens) > limit

    def generate(self, name: str, ids: list[int], stop: list[int], on_round):
        s = self.settings
        loop = LoopSettings(max_gen_len=s.length, gamma=s.gamma, eos_tokens_id=stop)
        if name == "target":
            return autoregressive_run(ids, self.target, s.length, s.processor, loop.eos_tokens_id, s.use_cache, on_round)
        if name == "drafter":
            return autoregressive_run(ids, self.drafter, s.length, s.processor, loop.eos_tokens_id, s.use_cache, on_round)
        if name == "speculative":
            return speculative_run(ids, self.drafter, self.target, s.processor, loop, s.use_cache, on_round,
                                   adaptive_gamma=s.adaptive_gamma, confidence=s.confidence)
        if s.reset_in_between:
            self.reset_storage()
        return nasd_run(ids, self.storage, self.target, s.processor, loop, s.top_k_filler, s.use_cache,
                        on_round=on_round)

    def warm_up(self) -> None:
        """One short run per model so the first prompt's figures do not include one-time costs."""
        ids = list(self.tokenizer("Hello")["input_ids"]) or [0]
        for model in {id(self.target): self.target, id(self.drafter): self.drafter}.values():
            for use_cache in (False, True):
                autoregressive_run(ids, model, 2, None, -1, use_cache)


def stats_line(r: Report) -> str:
    parts = [f"{r.tokens_generated} tokens", f"{r.seconds:.2f} s", f"{r.tokens_per_s:.2f} tokens/s"]
    if r.acceptance_rate is not None:
        parts.append(f"acceptance {r.acceptance_rate:.0%}")
    elif r.generator in ("speculative", "ngram"):
        parts.append("acceptance n/a (nothing drafted)")
    parts.append(f"{r.target_forwards} target forwards" if r.generator != "drafter"
                 else f"{r.drafter_forwards} drafter forwards")
    parts.append(f"speedup {r.speedup:.2f}x" if r.speedup is not None else "speedup n/a (/target is off)")
    return " · ".join(parts)


def report_json(r: Report) -> str:
    return json.dumps(asdict(r))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class Stream:
    """Prints the text as rounds arrive: decoded incrementally (whole words and characters only), or in debug
    mode, each round coloured."""

    def __init__(self, tokenizer, out, debug: bool):
        self.tokenizer, self.out, self.debug = tokenizer, out, debug
        self.tokens: list[int] = []
        self.shown = ""

    def on_round(self, step) -> None:
        if self.debug:
            print(format_round(self.tokenizer, step.drafts, step.accepted, step.tokens), file=self.out, flush=True)
            return
        self.tokens += step.tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
            return
        print(text[len(self.shown) :], end="", file=self.out, flush=True)
        self.shown = text

    def end(self) -> None:
        """Ends the answer's line, first printing text still held back: an answer may end inside a multi-byte
        character, and what it holds then is what the report has too."""
        if not self.debug:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True) if self.tokens else ""
            print(text[len(self.shown) :], file=self.out, flush=True)
            self.shown = text


def is_utf8(text: str) -> bool:
    """Bytes that were not UTF-8 reach Python (argv, a terminal) as lone surrogates, which tokenizers reject."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def chat_ids(tokenizer, prompt: str, history: list[dict] = ()) -> list[int]:
    """The conversation so far plus `prompt` as the next user turn, through the tokenizer's chat template, ready
    for the assistant's answer."""
    messages = [*history, {"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def stop_tokens(tokenizer, model, chat: bool) -> list[int]:
    """The ids that end an answer: the tokenizer's and the model's end tokens, and in chat the end-of-turn ones."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    if chat:
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in END_OF_TURN if t in vocab)
    return sorted(i for i in ids if i is not None)
