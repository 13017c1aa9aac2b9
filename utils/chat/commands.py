"""The slash-commands: each declared once, with its arguments and help; `/help` is generated from this table."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from typing import Callable

from ngram_assisted.ngram_storage import MAX_N, MIN_N
from sampling.draft_stop import DraftStopConfig, alias_config
from utils.model_runner import CACHE_OFF_WINDOW
from utils.chat.settings import (
    DRAFT_STOP_USAGE,
    GAMMA_RULE,
    PROCESSOR_USAGE,
    WINDOW_RULE,
    Settings,
    default_draft_stop,
    describe_gamma,
    describe_processor,
    draft_stop_now,
    parse_draft_stop,
    parse_gamma,
    parse_processor,
    parse_window,
    shown,
)


class CommandError(ValueError):
    """A bad command or argument: reported in one line, the settings unchanged."""


@dataclass(frozen=True)
class Arg:
    name: str
    parse: Callable[[str], object]
    rule: str  # what is accepted, for error messages and /help


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise ValueError
        return value

    return parse


def int_between(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise ValueError
        return value

    return parse


SEEDS = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts


def probability_below_one(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise ValueError
    return value + 0.0  # -0 as 0: shown back to the user


def ngram_kind(text: str) -> str:
    if text.lower() not in ("basic", "onelevel"):
        raise ValueError
    return text.lower()


@dataclass(frozen=True)
class Command:
    name: str
    args: tuple[Arg, ...]
    help: str
    run: Callable  # (session, *values) -> None
    current: Callable[[Settings], str] | None = None  # the value /help shows
    rest: str = ""  # the usage of free-form words (/processor NAME ARGS…), which the command parses itself
    verbatim: bool = False  # with `rest`: the rest of the line as typed, one string (a path's runs of spaces)

    @property
    def usage(self) -> str:
        if self.rest:
            return f"/{self.name} {self.rest}"
        return " ".join([f"/{self.name}"] + [a.name for a in self.args])


def toggle(field_name: str, label: str) -> Callable:
    def run(session) -> None:
        value = not getattr(session.settings, field_name)
        setattr(session.settings, field_name, value)
        session.say(f"{label}: {'on' if value else 'off'}")

    return run


def toggle_generator(name: str) -> Callable:
    def run(session) -> None:
        session.settings.enabled[name] = not session.settings.enabled[name]
        session.say(f"{name}: {'on' if session.settings.enabled[name] else 'off'}")

    return run


def setter(field_name: str) -> Callable:
    def run(session, value) -> None:
        setattr(session.settings, field_name, value)
        session.say(f"{field_name} = {value}")

    return run


def describe_draft_stop(s: Settings) -> str:
    now = draft_stop_now(s).describe()
    return s.draft_stop.describe() + (f" = {now}" if now != s.draft_stop.describe() else "")


def generator_state(name: str) -> Callable[[Settings], str]:
    return lambda s: "on" if s.enabled[name] else "off"


def on_off(field_name: str) -> Callable[[Settings], str]:
    return lambda s: "on" if getattr(s, field_name) else "off"


def set_processor(session, words: list[str]) -> None:
    try:
        session.settings.processor = parse_processor(words)
    except ValueError as error:
        raise CommandError(f"/processor: {error}") from None
    session.say(f"processor = {describe_processor(session.settings.processor)}")


def set_draft_stop(session, words: list[str]) -> None:
    from sampling.draft_stop import make_draft_stop

    try:
        config = parse_draft_stop(" ".join(words))
        rule = make_draft_stop(config, session.drafter)  # a head missing or made for another drafter: refused now
    except ValueError as error:
        raise CommandError(f"/draft_stop: {error}") from None
    session.settings.draft_stop, session.stop_rule = config, (config, rule)
    session.say(f"draft stop = {config.describe()}")


def set_gamma(session, gamma: int | None) -> None:
    session.settings.gamma = gamma
    session.say(f"gamma = {describe_gamma(session.settings)}")


def set_drafter_window(session, window: int | None) -> None:
    try:
        session.set_drafter_window(window)
    except ValueError as error:
        raise CommandError(f"/drafter_window: {error}") from None


def adaptive_on(settings: Settings) -> bool:
    """Whether the round's length follows acceptance: the adaptive rule, or confidence/entropy on its schedule."""
    config = settings.draft_stop
    return config.rule == "adaptive" or (config.adaptive and config.rule in ("confidence", "entropy"))


def toggle_adaptive(session) -> None:
    """The older switch, as --adaptive: on a confidence or entropy rule it adds or removes the length schedule
    and keeps the rule (as --adaptive --confidence P spells it); otherwise adaptive, and off, back to auto."""
    config, on = session.settings.draft_stop, not adaptive_on(session.settings)
    if config.rule in ("confidence", "entropy"):
        config = replace(config, adaptive=on)
    else:
        config = DraftStopConfig("adaptive") if on else default_draft_stop()
    session.settings.draft_stop = config
    session.say(f"adaptive gamma: {'on' if on else 'off'} (draft stop = {config.describe()})")


def set_confidence(session, value: float) -> None:
    """The older switch, as --confidence P: an adaptive length stays adaptive (P 0: adaptive alone, else fixed)."""
    adaptive = adaptive_on(session.settings)
    session.settings.draft_stop = alias_config(adaptive, value)
    session.say(f"confidence = {value:g} (draft stop = {session.settings.draft_stop.describe()})")


def answer_file(session, typed: str) -> list:
    from utils.chat.prompt_file import PromptFileError, read_prompt_file, typed_path

    path = typed_path(typed)
    try:
        text = read_prompt_file(path)
    except PromptFileError as error:
        raise CommandError(f"/file: {error}") from None
    session.say(f"(the prompt is {path}: {len(text)} characters)")
    return session.answer(text)


def toggle_prior(session) -> None:
    if not session.settings.ngram_prior and session.prior is None:
        session.load_prior()  # not loaded at start-up (--no-ngram-prior), or none there is
        if session.prior is None:
            raise CommandError("/ngram_prior: no usable prior for this tokenizer; NASD drafts from the conversation")
    toggle("ngram_prior", "ngram prior")(session)


def toggle_reset_in_between(session) -> None:
    toggle("reset_in_between", "reset_in_between")(session)
    if session.settings.reset_in_between and session.ngram_cache is not None:  # else the file is lost unsaid
        session.say(f"(each prompt's fresh storage replaces the n-gram cache: NASD's next answer saves it over "
                    f"{session.ngram_cache})")


def set_ngram_storage(session, kind: str, n: int) -> None:
    storage = session.make_storage(kind, n)  # first, so that an interrupted build changes nothing
    session.settings.ngram_kind, session.settings.ngram_n, session.storage = kind, n, storage
    kept = session.ngram_cache
    note = f" (empty: NASD's next answer saves it over {kept})" if kept is not None else ""
    session.say(f"n-gram storage = {kind} n={n}{note}")


COMMANDS: tuple[Command, ...] = (
    Command("help", (), "show the commands and current values", lambda s: s.show_help()),
    Command("quit", (), "leave (Ctrl-D or Ctrl-C at the prompt also leave)", lambda s: s.quit()),
    Command("clear", (), "clear the screen", lambda s: s.clear_screen()),
    Command("debug", (), "toggle colouring each speculative round (accepted, rejected, target's token)",
            toggle("debug", "debug"), on_off("debug")),
    Command("speculative", (), "toggle speculative decoding (drafter + target)", toggle_generator("speculative"),
            generator_state("speculative")),
    Command("ngram", (), "toggle NASD (n-gram storage + target)", toggle_generator("ngram"),
            generator_state("ngram")),
    Command("target", (), "toggle the target's autoregressive decoding (the speedup baseline)",
            toggle_generator("target"), generator_state("target")),
    Command("drafter", (), "toggle the drafter's autoregressive decoding", toggle_generator("drafter"),
            generator_state("drafter")),
    Command("cache", (), "toggle the KV cache for all generators (off by default; unstable, see the warning)",
            lambda s: s.toggle_cache(), on_off("use_cache")),
    Command("chat", (), "toggle chat mode (chat template, conversation kept across turns)",
            lambda s: s.toggle_chat(), on_off("chat")),
    Command("reset", (), "start a new conversation", lambda s: s.reset_conversation()),
    Command("length", (Arg("N", int_at_least(1), "an integer >= 1"),), "tokens to generate per answer",
            setter("length"), lambda s: str(s.length)),
    Command("gamma", (Arg("N", parse_gamma, GAMMA_RULE),), "most drafts per round (auto: 6; speculative with the "
            "cache on, greedy, confidence >= 0.9: the cap this machine's timed passes favour)", set_gamma,
            describe_gamma),
    Command("draft_stop", (), f"how many drafts a speculative round proposes, at most gamma: {DRAFT_STOP_USAGE}",
            set_draft_stop, describe_draft_stop, rest="RULE [X]"),
    Command("drafter_window", (Arg("N", parse_window, WINDOW_RULE),),
            "speculative: the drafter reads 4 sinks and its N-4 latest positions, a long prompt's prefill shrinks "
            f"to N (0: all; auto: {CACHE_OFF_WINDOW} with the cache off; lossless, the target reads everything)",
            set_drafter_window,
            lambda s: "auto" if s.drafter_window is None else str(s.drafter_window)),
    Command("draft_vocab", (Arg("N", int_at_least(0), "an integer >= 0"),),
            "speculative: the drafter's head computes only the N most frequent tokens and the conversation's "
            "(cheaper drafts; lossless, the target checks every draft; the drafter alone answers with it too; "
            "0: every token)",
            lambda s, n: s.set_draft_vocab(n), lambda s: str(s.draft_vocab or "all")),
    Command("adaptive", (), "toggle /draft_stop adaptive (+2 drafts after a fully accepted round, -1 after a "
            "rejection, at most gamma); off: back to auto; on a confidence or entropy rule, its length schedule",
            toggle_adaptive,
            lambda s: "on" if adaptive_on(s) else "off"),
    Command("confidence", (Arg("P", probability_below_one, "a number in [0, 1)"),),
            "/draft_stop confidence P: drafting stops after a draft whose top probability is below P (0: none); "
            "with /adaptive on, on its length",
            set_confidence,
            lambda s: f"{draft_stop_now(s).confidence if draft_stop_now(s).rule == 'confidence' else 0:g}"),
    Command("file", (), "send a text file's content as the prompt (a source file and a question in it)",
            answer_file, rest="PATH", verbatim=True),
    Command("processor", (), f"sampling: {PROCESSOR_USAGE}", set_processor,
            lambda s: describe_processor(s.processor), rest="NAME ARGS…"),
    Command("top_k_filler", (Arg("N", int_at_least(1), "an integer >= 1"),),
            "NASD learns the target's top-N tokens at each verified position (1: only the chosen one)",
            setter("top_k_filler"), lambda s: str(s.top_k_filler)),
    Command("set_ngramstorage", (Arg("basic|onelevel", ngram_kind, "basic or onelevel"),
                                 Arg("N", int_between(MIN_N, MAX_N), f"an integer from {MIN_N} to {MAX_N}")),
            "choose the n-gram storage: basic (contexts 1..N-1) or onelevel (N-1 only)", set_ngram_storage,
            lambda s: f"{s.ngram_kind} {s.ngram_n}"),
    Command("reset_in_between", (), "toggle a fresh n-gram storage for each prompt",
            toggle_reset_in_between, on_off("reset_in_between")),
    Command("ngram_prior", (), "toggle NASD's prior: drafts from the target's typical answers (shipped per tokenizer) "
            "where the storage knows no context", toggle_prior, on_off("ngram_prior")),
    Command("seed", (Arg("N", int_between(*SEEDS), "an integer from -2**63 to 2**64-1"),), "random seed each generator starts from",
            setter("seed"), lambda s: str(s.seed)),
)
BY_NAME = {c.name: c for c in COMMANDS}


def parse_command(line: str) -> tuple[Command, list]:
    """'/gamma 3' -> (the gamma command, [3]). Raises CommandError with one line that says what is accepted."""
    words = line.strip().split()
    name = words[0][1:].lower() if words and words[0].startswith("/") else ""
    command = BY_NAME.get(name)
    if command is None:
        # the commands the typed name begins (/gam: /gamma, which difflib ranked below /ngram; /draft_: two, never
        # the closer /drafter), else the closest spelling: a typo scores 0.75 or more, where at 0.5 /generators
        # was offered /set_ngramstorage
        starting = sorted(known for known in BY_NAME if name and known.startswith(name))
        close = starting or difflib.get_close_matches(name, BY_NAME, n=1, cutoff=0.6)
        hint = f"; did you mean {' or '.join('/' + known for known in close)}?" if close else ""
        raise CommandError(f"unknown command {shown(words[0]) if words else repr(line)}{hint} (/help lists them)")
    values = words[1:]
    if command.verbatim:
        return command, [line.strip()[len(words[0]):].lstrip()]
    if command.rest:
        return command, [values]
    if len(values) != len(command.args):
        expected = ", ".join(f"{a.name}: {a.rule}" for a in command.args) or "no arguments"
        raise CommandError(f"usage: {command.usage} ({expected})")
    parsed = []
    for place, (arg, text) in enumerate(zip(command.args, values), 1):
        try:
            parsed.append(arg.parse(text))
        except ValueError:
            subject = f"argument {place}" if "|" in arg.name else arg.name  # not "basic|onelevel must be …"
            raise CommandError(f"/{command.name}: {subject} must be {arg.rule}, got {shown(text)}") from None
    return command, parsed


def help_text(settings: Settings) -> str:
    width = max(len(c.usage) for c in COMMANDS)
    lines = []
    for c in COMMANDS:
        current = f"  [{c.current(settings)}]" if c.current else ""
        lines.append(f"  {c.usage:<{width}}  {c.help}{current}")
    return "\n".join(lines)
