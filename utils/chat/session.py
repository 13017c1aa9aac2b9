"""One chat session: runs every enabled generator on a prompt, streams its text and reports honest figures."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ngram_assisted import nasd_run
from ngram_assisted.ngram_cache import (KINDS, NGramCacheError, kind_of, load_storage, save_storage,
                                       tokenizer_fingerprint)
from ngram_assisted.ngram_prior import prior_fingerprint, shipped_prior
from sampling import LoopSettings, autoregressive_run, draft_cap, make_draft_stop, speculative_run
from sampling.draft_stop import DraftStopConfig
from sampling.translating_drafter import translated_ids
from utils.chat import interrupts
from utils.chat.commands import CommandError, help_text, parse_command
from utils.chat.prompt_tokens import chat_ids, stop_tokens, text_ids
from utils.caching import CACHE_POLICIES, cache_refusal, kv_budget, kv_policy
from utils.model_runner import ModelRunner, check_window, context_limit, synchronize, window_for
from utils.models.draft_vocab import start_shortlist
from utils.printing import RoundTexts, bars_shown, format_round, one_line, paint, takes_escapes
from utils.chat.report import Report, stats_line
from utils.chat.settings import (GENERATOR_TITLES, GENERATORS, Settings, describe_window, draft_stop_now,
                                 measures_cap, untimed_gamma)

# Prompt tokens from which the cache off is worth a line: a 512-token prefill takes 2.2 s on the Zen 5 and 7.8 s on
# the Zen 3 (benchmarks/RESULTS.md, issue 21), so a 1024-token pass takes 4-16 s, and a 35-token answer reads it
# ~37 times for the target alone: minutes.
LONG_CACHE_OFF = 1024

CACHE_WARNING = (
    "Warning: the KV cache is unstable across models: it may raise errors or change the output. "
    "Use it with caution."
)


class Session:
    def __init__(self, target, drafter, tokenizer, settings: Settings, json_mode: bool = False,
                 drafter_tokenizer=None, drafter_own_tokenizer=None):
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        # A drafter with another vocabulary drafts through text (sampling/translating_drafter.py); None: the same.
        self.drafter_tokenizer = drafter_tokenizer
        # The drafter's own, which shows its answer alone: the same vocabulary may be the target's plus ids past it
        self.drafter_own_tokenizer = drafter_own_tokenizer or drafter_tokenizer or tokenizer
        self.settings = settings
        settings.text_drafter = drafter_tokenizer is not None
        self.out = sys.stderr if json_mode else sys.stdout  # in JSON mode stdout carries only the JSON objects
        self.json_mode = json_mode
        self.history: list[dict] = []
        self.running = True
        self.answering = False  # the current line reached the generators (a Ctrl-C then interrupts an answer)
        self.interrupt_note = ""  # what a Ctrl-C of this line's answer did to the conversation, for its message
        self.limit = context_limit(target)
        self.kept: dict[str, object] = {}  # generator -> its runners, KV caches kept across turns (cache on)
        self.ngram_cache = None  # the file NASD's storage is loaded from and saved to (--ngram-cache)
        self.fingerprint = None  # of the tokenizer, which the n-gram cache file records
        self.prior = None  # NASD's shipped prior for this tokenizer (load_prior), None where there is none
        self.length_noted: int | None = None  # the /length already named as what empties the conversation
        self.finished: list[Report] = []  # the last prompt's answers, as far as they came
        self.long_noted: set[str] = set()  # what a long prompt costs, said once a session ("cache off", "budget")
        self.stop_rule = None  # (its config, the speculative draft-stop rule), see draft_stop()
        self.reset_storage()

    # -- messages -------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def error(self, text: str) -> None:
        print(self.paint(text, "red"), file=self.out, flush=True)

    def paint(self, text: str, color: str, **kwargs) -> str:
        return paint(text, color, self.out, **kwargs)  # coloured where the session's output shows colours

    def show_help(self) -> None:
        self.say("Type a prompt to have every enabled generator answer it (start it with // to send one that begins "
                 "with /), or a command:\n" + help_text(self.settings))

    def quit(self) -> None:
        self.running = False

    def clear_screen(self) -> None:
        if not takes_escapes(self.out):  # (NO_COLOR is about colours only)
            self.say("(/clear: the output is no terminal that clears: a file, a pipe or TERM=dumb)")
            return
        print("\033[2J\033[H", end="", file=self.out, flush=True)

    # -- settings with side effects -------------------------------------------------------------------------
    def toggle_cache(self) -> None:
        if self.settings.use_cache and kv_policy(self.target) in CACHE_POLICIES:
            raise CommandError(f"the {kv_policy(self.target)} policy evicts from the KV cache: the cache stays on")
        if not self.settings.use_cache and (refusal := self.cache_refusal()):
            raise CommandError(f"the cache stays off: {refusal}")
        self.settings.use_cache = not self.settings.use_cache
        self.kept.clear()
        self.say(f"cache: {'on' if self.settings.use_cache else 'off'}")
        if self.settings.use_cache:
            self.error(CACHE_WARNING)

    def cache_refusal(self) -> str | None:
        """Why the target or the drafter cannot keep a KV cache (`utils.caching.cache_refusal`), or None."""
        return cache_refusal(self.target) or cache_refusal(self.drafter)

    def set_drafter_window(self, window: int | None) -> None:
        if window is not None:
            check_window(window, self.drafter)  # ValueError: the settings stay
        self.settings.drafter_window = window
        self.kept.pop("speculative", None)  # its drafter's cache was built for the old window
        self.say(f"drafter window = {describe_window(window)}")

    def drafter_window(self) -> int:
        """The window the drafter reads now (an "auto" setting follows the cache)."""
        return window_for(self.settings.drafter_window, self.settings.use_cache, self.drafter)

    def set_draft_vocab(self, size: int) -> None:
        from utils.models.draft_vocab import shortlisted, use_draft_vocab

        if self.drafter is self.target:
            raise CommandError("the drafter is the target: its head stays whole (the target's tokens are the answer)")
        note = use_draft_vocab(self.drafter, self.drafter_tokenizer or self.tokenizer, size)
        self.settings.draft_vocab = size if shortlisted(self.drafter) else 0  # a size past the vocabulary: all
        self.settings.measured_cap = None  # a drafter step costs what its new head costs: timed again
        self.say(f"draft vocab = {self.settings.draft_vocab or 'all'}" + (f" ({note})" if note else ""))

    def toggle_chat(self) -> None:
        if not self.settings.chat and not self.tokenizer.chat_template:
            raise CommandError("this tokenizer has no chat template; chat mode stays off")
        self.settings.chat = not self.settings.chat
        self.say(f"chat: {'on' if self.settings.chat else 'off'}")

    def reset_conversation(self) -> None:
        self.history.clear()
        self.kept.clear()
        self.say("new conversation")

    def reset_storage(self) -> None:
        self.storage = self.make_storage(self.settings.ngram_kind, self.settings.ngram_n)

    def make_storage(self, kind: str, n: int):
        return KINDS[kind](n, self.target.config.vocab_size)

    def load_prior(self) -> str:
        """Loads NASD's prior shipped for this tokenizer (the setting goes off where there is none); says what it
        holds, for the start-up line."""
        try:
            self.prior = shipped_prior(prior_fingerprint(self.tokenizer), self.target.config.vocab_size)
        except NGramCacheError as error:  # a damaged install: NASD drafts from the conversation alone
            self.error(f"{error}; NASD drafts without its prior")
        if self.prior is None:
            self.settings.ngram_prior = False
            return ""
        off = "" if self.settings.ngram_prior else " (off)"
        return f"NASD prior: {self.prior.contexts()} contexts of the target's answers{off}"

    def use_ngram_cache(self, path: str) -> None:
        """Loads NASD's storage from `path` when it exists and saves it there after every answer; the storage is
        then kept across prompts. A file that cannot be used gets one line: the chat goes on with an empty
        storage and leaves the file as it is."""
        self.settings.reset_in_between = False
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        if Path(path).exists() and Path(path).stat().st_size > 0:  # an empty file (`touch`) is an empty storage
            try:
                self.storage = load_storage(path, self.fingerprint, self.target.config.vocab_size)
            except NGramCacheError as error:
                self.error(f"{error}; NASD starts with an empty storage and will not overwrite the file")
                return
            self.settings.ngram_kind = kind_of(self.storage)
            self.settings.ngram_n = self.storage.n
            self.say(f"n-gram cache: {self.storage.contexts()} contexts loaded from {path}")
        self.ngram_cache = path

    def save_ngram_cache(self) -> None:
        try:
            save_storage(self.ngram_cache, self.storage, self.fingerprint)
        except NGramCacheError as error:
            self.error(str(error))

    # -- one line of input ----------------------------------------------------------------------------------
    def handle(self, line: str) -> list[Report]:
        """A REPL line: a command, or a prompt (`//` escapes a prompt that starts with `/`)."""
        line = line.strip()
        self.answering = False
        if not line:  # Enter alone, or spaces: said, as `--prompt` says it, rather than a silent new prompt
            raise CommandError("the prompt is empty: type a prompt, or /help for the commands")
        if line.startswith("//"):
            return self.answer(line[1:])
        if line.startswith("/"):
            command, values = parse_command(line)
            return command.run(self, *values) or []  # /file answers a prompt: its reports
        return self.answer(line)

    def answer(self, prompt: str) -> list[Report]:
        if not is_utf8(prompt):
            raise CommandError("the input is not valid UTF-8")
        if not any(self.settings.enabled.values()):
            raise CommandError("every generator is off; turn one on with /target, /speculative, /ngram or /drafter")
        self.answering, self.interrupt_note = True, ""
        reports, history, kept = [], None, None
        self.finished = reports  # the answers so far, for a caller that a Ctrl-C reaches (`--json`)
        try:
            ids, history = self.fit_context(prompt)
            self.note_long_prompt(len(ids))
            baseline: float | str = "/target is off"  # the target's tokens/s, or why there is none
            stop = self.stop_tokens()  # once per prompt, outside the timed generations
            if self.settings.enabled["ngram"] and self.settings.ngram_prior and self.prior is None:
                # not loaded yet (a session the CLI did not start): a load that finds none turns the setting off
                self.load_prior()
            for name in GENERATORS:
                if self.settings.enabled[name]:
                    report = self.run_block(name, ids, stop, baseline)
                    reports.append(report)
                    if name == "target":
                        baseline = ("the target's answer failed" if report.error is not None else
                                    report.tokens_per_s or "the target answered no token")
            kept = self.keep_turn(prompt, history, reports)
            if self.ngram_cache is not None and self.settings.enabled["ngram"]:
                self.save_ngram_cache()  # after every answer: a killed session loses at most the answer in progress
        except KeyboardInterrupt:  # the answers shown before the Ctrl-C are answers: the turn keeps one
            if kept is None and history is not None:
                kept = self.keep_turn(prompt, history, reports)
            if self.conversing:
                self.interrupt_note = (f"; the conversation keeps the answer of {GENERATOR_TITLES[kept].split(' (')[0]}"
                                       if kept else "; the conversation goes on without this prompt")
            raise
        return reports

    def note_long_prompt(self, length: int) -> None:
        """A line, once a session, where a prompt costs or loses more than its user may expect: with the cache off
        every pass of every answer reads the whole prompt again (17k tokens: minutes a token on 2 cores), and a KV
        budget shorter than the prompt hides most of it from the models."""
        if not self.settings.use_cache and length >= LONG_CACHE_OFF and "cache off" not in self.long_noted:
            self.long_noted.add("cache off")
            self.say(self.paint(f"(the cache is off: every pass of each answer reads all {length} tokens again, "
                                "which takes long at this size; the cache (/cache, --cache) reads them once)",
                                "yellow"))
        budget = kv_budget(self.target)
        if budget is not None and length > sum(budget) and "budget" not in self.long_noted:
            self.long_noted.add("budget")
            self.say(self.paint(f"(the prompt's {length} tokens exceed the KV budget of {sum(budget)} positions: the "
                                "models attend only to those it keeps)", "yellow"))

    def keep_turn(self, prompt: str, history: list[dict], reports: list[Report]) -> str | None:
        """The prompt and its answer join the conversation (the target's, else speculative decoding's or NASD's,
        else the drafter's), with `history`: the turns kept beside this prompt. Which generator's answer did, if
        any. Only an answer changes the conversation: a turn that every generator failed, or one stopped before any
        answered, leaves it as it was, the turns dropped to fit this prompt included."""
        answered = [r for r in reports if r.error is None]
        if not (self.conversing and answered):
            return None
        reply = next((r for r in answered if r.generator != "drafter"), answered[0])
        self.history[:] = history + [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply.text}]
        return reply.generator

    def fit_context(self, prompt: str) -> tuple[list[int], list[dict]]:
        """The prompt's ids and the conversation they were read with, after dropping the oldest turns (a system
        prompt stays) until the prompt and a full answer fit the target's context, with a one-line notice. The
        session's own history is left as it is (`answer` keeps the shorter one once answered). A prompt that does
        not fit even alone is refused."""
        history, dropped = list(self.history), 0
        ids = self.encode(prompt, history)
        while self.conversing and self.limit is not None and len(ids) + self.settings.length > self.limit:
            turns = [i for i, m in enumerate(history) if m["role"] != "system"]
            if not turns:
                break
            del history[turns[0] : turns[1] + 1 if len(turns) > 1 else turns[0] + 1]  # a user turn and its reply
            ids, dropped = self.encode(prompt, history), dropped + 1
        if self.limit is not None and len(ids) >= self.limit:
            raise CommandError(f"the prompt is {len(ids)} tokens long; the target's context is {self.limit}")
        if dropped:
            turns = f"turn{'s' if dropped > 1 else ''}"
            self.say(self.paint(f"(dropped the {dropped} oldest {turns} of the conversation to fit the context of "
                                f"{self.limit} tokens)", "yellow"))
            length = self.settings.length
            if not any(m["role"] != "system" for m in history) and self.length_noted != length:
                # Not one earlier turn fits beside a full answer: at this length every turn starts afresh, which the
                # line above does not say. Said once per length, not at every turn.
                self.length_noted = length
                self.say(self.paint(f"(no earlier turn fits beside an answer of /length {length} in the context of "
                                    f"{self.limit} tokens, so each turn is answered without the conversation; a "
                                    "smaller /length keeps it)", "yellow"))
        return ids, history

    @property
    def conversing(self) -> bool:
        """Chat mode with a template to apply: prompts are read with the history, and answers join it. With chat
        off the history is kept aside (neither read nor dropped) for when it comes back on."""
        return bool(self.settings.chat and self.tokenizer.chat_template)

    def encode(self, prompt: str, history: list[dict] | None = None) -> list[int]:
        if not self.conversing:
            return text_ids(self.tokenizer, prompt)
        try:
            return chat_ids(self.tokenizer, prompt, self.history if history is None else history)
        except Exception as error:  # a template that does not parse, or refuses this conversation (raise_exception)
            if type(error).__module__.split(".")[0] != "jinja2":
                raise
            raise CommandError(f"the model's chat template fails ({type(error).__name__}: {one_line(error)}); /chat "
                               "(--no-chat) reads prompts as plain text") from None

    def stop_tokens(self) -> list[int]:
        return stop_tokens(self.tokenizer, self.target, self.settings.chat)

    # -- one generator --------------------------------------------------------------------------------------
    def run_block(self, name: str, ids: list[int], stop: list[int], baseline: float | str | None) -> Report:
        """baseline: the target's tokens/s on this prompt, for the speedup; or why there is none."""
        self.say(self.paint(f"── {GENERATOR_TITLES[name]} ──", "cyan", attrs=["bold"]))
        tokenizer = self.tokenizer
        if name == "drafter":  # the drafter alone speaks in its own words (ids past the target's too)
            tokenizer = self.drafter_own_tokenizer
            if self.drafter_tokenizer is not None:  # another vocabulary: its own prompt ids and end tokens too
                ids, stop = self.drafter_ids(ids), stop_tokens(tokenizer, self.drafter, self.settings.chat)
        stream = Stream(tokenizer, self.out, self.settings.debug and name in ("speculative", "ngram"))
        torch.manual_seed(self.settings.seed)
        first: list[float] = []

        def on_round(step) -> None:
            interrupts.check()  # a Ctrl-C whose KeyboardInterrupt something swallowed stops the answer here
            # The loop hands over a round's tokens as host ints, so the device has finished them by now.
            if not first:
                first.append(time.perf_counter())
            stream.on_round(step)

        gamma = self.gamma_for(name)  # before the clock: a first use with the cache on times passes
        try:
            synchronize(self.target.device)
            start = time.perf_counter()
            result = self.generate(name, ids, stop, on_round, gamma)
            synchronize(self.target.device)
            seconds = time.perf_counter() - start
        except Exception as error:  # whatever one generator raises, the others' reports are not lost
            self.kept.pop(name, None)
            if isinstance(error, BrokenPipeError):  # stdout's reader left: nothing more can be shown
                raise
            stream.end()
            message = f"{type(error).__name__}: {one_line(error)}"
            self.error(f"{name} failed: {message}")
            return Report(name, "", [], 0, 0.0, 0.0, None, None, 0, 0, error=message)
        except BaseException:  # Ctrl-C mid-pass: the cache may hold entries its runner does not count
            kept = self.kept.get(name)
            if kept is not None and not all(r.recover() for r in (kept if isinstance(kept, tuple) else (kept,))):
                self.kept.pop(name, None)  # else the next turn reuses what each runner counts
            raise
        stream.end()
        count = len(result.tokens)
        tps = count / seconds if seconds > 0 else 0.0
        # Acceptance of nothing proposed is undefined, not 0%.
        acceptance = result.acceptance_rate if name in ("speculative", "ngram") and result.drafted else None
        if name == "drafter" and self.drafter_tokenizer is not None:  # a rate of another tokenizer's tokens over
            baseline = "it counts another tokenizer's tokens"  # the target's rate would compare nothing
        speedup = tps / baseline if isinstance(baseline, float) else (1.0 if name == "target" else None)
        # The drafter's autoregressive run drives the drafter through the loop's "target" slot.
        forwards = (0, result.target_calls) if name == "drafter" else (result.target_calls, result.drafter_calls)
        report = Report(name, tokenizer.decode(result.tokens, skip_special_tokens=True), result.tokens, count,
                        seconds, tps, acceptance, speedup, *forwards, first_token_s=first[0] - start if first else None,
                        drafted=result.drafted, accepted=result.accepted, rounds=result.rounds,
                        draft_stop=self.stop_config().describe() if name == "speculative" else None,
                        gamma=gamma if name in ("speculative", "ngram") else None)
        self.say(self.paint(stats_line(report, baseline if isinstance(baseline, str) else "/target is off"),
                            "yellow"))
        if self.stopped_by_context(name, len(ids), result.tokens, stop):
            hint = "; /reset starts a new conversation" if self.conversing else ""
            self.say(self.paint(f"(the answer stopped because the context of {self.limit_of(name)} tokens is "
                                f"full{hint})", "yellow"))
        if name == "speculative" and not result.drafted and (limit := self.drafter_outgrown(ids)):
            self.say(self.paint(f"(the drafter's context of {limit} tokens is shorter than the sequence: it drafted "
                                "nothing, and the target answered alone)", "yellow"))
        return report

    def limit_of(self, name: str) -> int | None:
        return context_limit(self.drafter if name == "drafter" else self.target)

    def drafter_outgrown(self, ids: list[int]) -> int | None:
        """The drafter's context where the prompt alone fills it (it can then draft nothing), else None."""
        limit = context_limit(self.drafter)
        if limit is None:
            return None
        drafter_len = len(self.drafter_ids(ids)) if self.drafter_tokenizer is not None else len(ids)
        return limit if drafter_len >= limit else None

    def stopped_by_context(self, name: str, prompt_len: int, tokens: list[int], stop: list[int]) -> bool:
        limit = self.limit_of(name)
        ended = bool(tokens) and tokens[-1] in stop
        # The loop's budget ends a sequence one past the context (its last token is never fed back).
        return limit is not None and not ended and len(tokens) < self.settings.length and prompt_len + len(tokens) > limit

    def gamma_for(self, name: str) -> int:
        """The most drafts a round of `name` proposes: the setting, or under `auto` this machine's measured cap
        (speculative decoding where `measures_cap`; timed at its first use, a note saying so) or FALLBACK_CAP."""
        s = self.settings
        if name != "speculative" or not measures_cap(s):
            return untimed_gamma(s)
        if s.measured_cap is None:
            try:
                s.measured_cap, _ = draft_cap.load_or_measure(self.target, self.drafter, note=self.say)
                s.cap_source = "timed here"
            except Exception as error:  # out of memory, a model the timing cannot feed: the answer still comes
                s.measured_cap, s.cap_source = draft_cap.FALLBACK_CAP, "the timing failed"
                self.error(f"the draft cap could not be timed ({type(error).__name__}: {one_line(error)}); "
                           f"gamma auto is {s.measured_cap} in this session")
        return s.measured_cap

    def generate(self, name: str, ids: list[int], stop: list[int], on_round, gamma: int):
        s = self.settings
        loop = LoopSettings(max_gen_len=s.length, gamma=gamma, eos_tokens_id=stop)
        runners = self.runners(name)
        if name in ("target", "drafter"):
            model = self.target if name == "target" else self.drafter
            if name == "drafter":  # a shortlist head hears this prompt's ids, as the speculative drafter does
                start_shortlist(model, torch.tensor(ids))
            return autoregressive_run(ids, model, s.length, s.processor, loop.eos_tokens_id, s.use_cache, on_round,
                                      runner=runners)
        if name == "speculative":
            return speculative_run(ids, self.drafter, self.target, s.processor, loop, s.use_cache, on_round,
                                   runners=runners, tokenizer=self.tokenizer, drafter_tokenizer=self.drafter_tokenizer,
                                   draft_stop=self.draft_stop(), drafter_window=self.drafter_window())
        if s.reset_in_between:
            self.reset_storage()
        return nasd_run(ids, self.storage, self.target, s.processor, loop, s.top_k_filler, s.use_cache,
                        on_round=on_round, runner=runners, prior=self.prior if s.ngram_prior else None)

    def draft_stop(self):
        """The speculative rule, kept while its setting stays (a learned rule keeps what it measured); for a
        translating drafter, its config (the loop builds its length schedule)."""
        config = self.stop_config()
        if self.drafter_tokenizer is not None:
            return config
        if self.stop_rule is None or self.stop_rule[0] != config:
            self.stop_rule = (config, make_draft_stop(config, self.drafter))  # configs are replaced, never edited
        return self.stop_rule[1]

    def stop_config(self) -> DraftStopConfig:
        return draft_stop_now(self.settings)

    def runners(self, name: str):
        """A generator's runners, which read long passes in chunks with a progress bar. With the cache on, each
        generator keeps them (and their KV caches) from turn to turn; each new prompt then feeds only what
        follows the prefix it shares with the last one."""
        s = self.settings
        if name in self.kept and s.use_cache:
            return self.kept[name]

        def runner(model, window=0, bar=True):
            return ModelRunner(model, use_cache=s.use_cache, prefill_chunk=s.prefill_chunk,
                               progress=prefill_bar if bar and not self.json_mode else None, window=window)

        if name == "speculative":
            # The drafter reads the prompt after the first token is shown: a bar then would overwrite its line.
            made = (runner(self.target), runner(self.drafter, self.drafter_window(), bar=False))
        else:
            made = runner(self.drafter if name == "drafter" else self.target)
        if s.use_cache:
            self.kept[name] = made
        return made

    def drafter_ids(self, ids: list[int]) -> list[int]:
        """The target's prompt as the drafter's tokenizer reads it (through text, control tokens included)."""
        return translated_ids(ids, self.tokenizer, self.drafter_tokenizer) or [0]

    def warm_up(self) -> None:
        """One short run per model so the first prompt's figures do not include one-time costs."""
        ids = list(self.tokenizer("Hello")["input_ids"]) or [0]
        runs = {id(self.target): (self.target, ids), id(self.drafter): (self.drafter, ids)}
        if self.drafter_tokenizer is not None:
            runs[id(self.drafter)] = (self.drafter, self.drafter_ids(ids))
        for model, model_ids in runs.values():
            if kv_policy(model) in CACHE_POLICIES:
                modes = (True,)
            else:
                modes = (False,) if cache_refusal(model) else (False, True)
            for use_cache in modes:
                autoregressive_run(model_ids, model, 2, None, -1, use_cache)


def prefill_bar(total: int):
    """A bar on the terminal for a chunked prefill, shown only once it has taken two seconds (`bars_shown`: not
    stuck to the answer's text in a file or a pipe). No time left is shown: each chunk attends to all before it,
    so a long prompt's chunks slow down as it goes (17k tokens: 6 min where the first chunks foretold 1.5)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="reading the prompt", unit="tok", delay=2.0, leave=False, file=sys.stderr,
                disable=not bars_shown(),
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}]")


class Stream:
    """Prints the text as rounds arrive: decoded incrementally (whole words and characters only), or in debug
    mode, each round coloured."""

    def __init__(self, tokenizer, out, debug: bool):
        self.tokenizer, self.out, self.debug = tokenizer, out, debug
        self.tokens: list[int] = []
        self.shown = ""
        self.round_texts = RoundTexts(tokenizer)

    def on_round(self, step) -> None:
        if self.debug:
            print(format_round(self.round_texts, step.drafts, step.accepted, step.tokens, self.out), file=self.out,
                  flush=True)
            return
        self.tokens += step.tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
            return
        print(text[len(self.shown) :], end="", file=self.out, flush=True)
        self.shown = text

    def end(self) -> None:
        """Ends the answer's line, first printing text still held back: an answer may end inside a multi-byte
        character, and what it holds then is what the report has too (in debug mode, on a line of its own, in the
        target's colour)."""
        if self.debug:
            held = self.round_texts.held()
            if held:
                print(paint(held, "blue", self.out), file=self.out, flush=True)
            return
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
