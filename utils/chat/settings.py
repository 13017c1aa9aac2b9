"""The REPL's settings, decided once and passed down; every slash-command edits one field."""

from __future__ import annotations

from dataclasses import dataclass, field

from sampling import draft_cap
from sampling.draft_stop import DRAFT_STOPS, DraftStopConfig, alias_config, resolve
from utils.caching import SINKS
from utils.model_runner import CACHE_OFF_WINDOW
from utils.models.draft_vocab import DEFAULT_DRAFT_VOCAB
from utils.logits_processor import (
    TEMPERATURE_RANGE,
    GreedyProcessor,
    LogitsProcessor,
    MultinomialProcessor,
    NucleusProcessor,
    TopKNucleusProcessor,
    TopKProcessor,
)

GENERATORS = ("target", "speculative", "ngram", "drafter")  # run order: the target's AR is the speedup baseline
GENERATOR_TITLES = {
    "target": "target autoregressive",
    "speculative": "speculative decoding (drafter + target)",
    "ngram": "NASD (n-gram storage + target)",
    "drafter": "drafter autoregressive",
}



def parse_generators(text: str) -> dict[str, bool]:
    """`"target,ngram"` -> which generators are enabled; ValueError naming the accepted names otherwise."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in GENERATORS]
    if unknown or not names:
        raise ValueError(f"{'unknown ' + repr(unknown[0]) if unknown else 'no generator named'}; "
                         f"use a comma-separated list of {', '.join(GENERATORS)}")
    return {g: g in names for g in GENERATORS}


# name -> (class, argument names and parsers, the usage text of its arguments)
PROCESSORS = {
    "greedy": (GreedyProcessor, [("temperature", float)], "greedy [T]"),
    "multinomial": (MultinomialProcessor, [("temperature", float)], "multinomial T"),
    "topk": (TopKProcessor, [("temperature", float), ("top_k", int)], "topk T K"),
    "nucleus": (NucleusProcessor, [("temperature", float), ("top_p", float)], "nucleus T P"),
    "topknucleus": (TopKNucleusProcessor, [("temperature", float), ("top_k", int), ("top_p", float)], "topknucleus T K P"),
}
PROCESSOR_USAGE = "; ".join(spec[2] for spec in PROCESSORS.values())
PARAMETER_RULES = {"temperature": "{:g} <= T <= {:g}".format(*TEMPERATURE_RANGE), "top_k": "K an integer >= 1",
                   "top_p": "0 < P <= 1"}


def processor_usage(name: str) -> str:
    """One processor's form and the ranges of its own parameters: 'topk T K (1e-06 <= T <= 1e+06, K ...)'."""
    _, params, usage = PROCESSORS[name]
    return f"usage: {usage} ({', '.join(PARAMETER_RULES[p] for p, _ in params)})"


def parse_processor(words: list[str]) -> LogitsProcessor:
    """`["topk", "0.8", "40"]` -> TopKProcessor(0.8, 40); ValueError with the accepted forms otherwise."""
    if not words or words[0].lower() not in PROCESSORS:
        raise ValueError(f"processor must be one of: {PROCESSOR_USAGE}")
    name = words[0].lower()
    cls, params, _ = PROCESSORS[name]
    values = words[1:]
    required = len(params) if name != "greedy" else 0
    if not required <= len(values) <= len(params):
        raise ValueError(processor_usage(name))
    try:
        kwargs = {pname: parse(v) for (pname, parse), v in zip(params, values)}
    except ValueError:
        raise ValueError(processor_usage(name)) from None
    return cls(**kwargs)  # the processor validates ranges with its own message


def describe_processor(processor: LogitsProcessor) -> str:
    name = next(n for n, spec in PROCESSORS.items() if type(processor) is spec[0])
    values = [getattr(processor, pname) for pname, _ in PROCESSORS[name][1]]
    return " ".join([name] + [f"{v:g}" if isinstance(v, float) else str(v) for v in values])


DRAFT_STOP_USAGE = "fixed; adaptive; confidence [P]; entropy [BOUND]; learned [HEAD_FILE]; auto"
# The chat's rule until told otherwise (the library's loops keep a fixed gamma): confidence 0.9 with the cache on,
# 0.6 with it off (0.75 off and sampling; sampling/draft_stop.py). Cache on, against fixed gamma 3, greedy,
# held-out prompts, at most 3 drafts / 6: code-writing -2.9% / -1.1%, code-editing +0.8% / +6.2%, chat +13.7% /
# +16.4% (Zen 3); cache off, greedy, 0.86x / 0.89x / 0.93x the time of fixed gamma 3, held out (Zen 5;
# benchmarks/RESULTS.md, issue 23).
DEFAULT_DRAFT_STOP = "auto"


def default_draft_stop() -> DraftStopConfig:
    return parse_draft_stop(DEFAULT_DRAFT_STOP)


def parse_draft_stop(text: str) -> DraftStopConfig:
    """`"entropy 0.4"` -> DraftStopConfig("entropy", entropy_bound=0.4); ValueError naming the forms."""
    words = text.split(maxsplit=1)  # a head's path may hold spaces
    rule = words[0].lower() if words else ""
    if rule not in DRAFT_STOPS:
        raise ValueError(f"draft stop must be one of: {DRAFT_STOP_USAGE}")
    if len(words) > 1 and rule in ("fixed", "adaptive", "auto"):
        raise ValueError(f"{rule} takes no value (the most drafts a round is /gamma); the rules: {DRAFT_STOP_USAGE}")
    value = words[1].strip() if len(words) > 1 else None
    if rule == "learned":
        return DraftStopConfig(rule, head=value)
    if value is not None and len(value.split()) > 1:
        raise ValueError(f"{rule} takes one value, got {value!r}")
    try:
        number = {} if value is None else {"confidence" if rule == "confidence" else "entropy_bound": float(value)}
    except ValueError:
        raise ValueError(f"{rule}: {value!r} is not a number in [0, 1)") from None
    return DraftStopConfig(rule, **number)  # which checks the range


def shown(text: str, most: int = 40) -> str:
    """A user's argument, quoted for an error line: cut where it is long (a 5000-digit number)."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}… ({len(text)} characters)"


WINDOW_RULE = f"auto, 0 (all) or an integer >= {2 * SINKS}"  # the model runner refuses fewer positions


def parse_window(text: str) -> int | None:
    """A drafter window setting: "auto" (None) or an integer >= 0 (ValueError otherwise; the runner checks that
    a window holds its sinks and as many latest positions)."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"a drafter window is {WINDOW_RULE}, got {shown(text)}")
    return value


def describe_window(window: int | None) -> str:
    if window is None:
        return f"auto ({CACHE_OFF_WINDOW} with the cache off, all with it on)"
    if not window:
        return "0 (the drafter reads everything)"
    return f"{window} ({SINKS} sinks + the {window - SINKS} latest positions)"


def draft_stop_from_flags(text: str | None, adaptive: bool, confidence: float) -> DraftStopConfig:
    """--draft-stop (None: not given, the chat's default), or its older spellings --adaptive and --confidence P
    (together: confidence on an adaptive length, as before); both kinds at once are ambiguous, except with
    `fixed`, which the older spellings refine."""
    config = parse_draft_stop(text) if text is not None else default_draft_stop()
    if not (adaptive or confidence):
        return config
    if text is not None and config.rule != "fixed":
        given = [flag for flag, on in (("--adaptive", adaptive), ("--confidence", confidence)) if on]
        spelt = "is an older spelling" if len(given) == 1 else "are older spellings"
        raise ValueError(f"{' and '.join(given)} {spelt} of --draft-stop: give one of them")
    return alias_config(adaptive, confidence)


@dataclass
class Settings:
    gamma: int | None = None  # most drafts per round; None ("auto"): 6, or speculative decoding's cap timed on
    # this machine where `measures_cap` (Session.gamma_for). The draft stop (auto: confidence) ends a round earlier
    draft_stop: DraftStopConfig = field(default_factory=default_draft_stop)  # speculative: how many of up to
    # gamma drafts a round proposes (sampling/draft_stop.py; DEFAULT_DRAFT_STOP above)
    drafter_window: int | None = None  # speculative: the drafter reads 4 sinks + its N-4 latest positions (0: all
    # of them; None, "auto": CACHE_OFF_WINDOW with the cache off, all with it on, `window_for`)
    draft_vocab: int = DEFAULT_DRAFT_VOCAB  # the drafter's head over the N most frequent tokens + the conversation's
    length: int = 35  # new tokens per answer, at most
    processor: LogitsProcessor = field(default_factory=GreedyProcessor)  # the same for every generator
    seed: int = 42  # every generator starts each prompt from this seed
    use_cache: bool = False  # the KV cache: off by default, see the warning /cache prints
    prefill_chunk: int = 32  # positions per prefill pass with the cache on: a progress bar (after 2 s) and Ctrl-C
    # land between passes; 32 rows are 8 tiles of our kernels, ~1.5 s for the 1.5B on a 2-core Zen 1
    chat: bool = True  # apply the chat template and keep the conversation
    debug: bool = False  # colour each speculative round: accepted, rejected, the target's token
    enabled: dict[str, bool] = field(default_factory=lambda: {g: True for g in GENERATORS})
    top_k_filler: int = 3  # NASD also learns the target's top-k tokens at each verified position
    ngram_kind: str = "basic"  # "basic": contexts of every length up to n-1; "onelevel": n-1 only
    ngram_n: int = 4  # the n of the n-gram storage: contexts up to 3 tokens (drafts need at least 2)
    reset_in_between: bool = True  # a fresh n-gram storage for each prompt
    ngram_prior: bool = True  # NASD also drafts from the prior shipped for the target's tokenizer, where its storage
    # knows no context (ngram_assisted/ngram_prior.py; held out, NASD's time 0.77-0.93x cache off, 0.80-0.99x on)
    text_drafter: bool = False  # the drafter has another tokenizer and drafts through text (set by the session)
    measured_cap: int | None = None  # the cap this machine's pass costs chose, once timed (set by the session)
    cap_source: str = "timed here"  # how measured_cap was chosen: timed (or read back), or the timing failed


def draft_stop_now(settings: Settings) -> DraftStopConfig:
    """The draft-stop rule a speculative round runs now. `auto` follows the cache setting and greedy or sampled
    decoding. A drafter of another tokenizer drafts text, with no distribution for a rule to read: under `auto` or
    `adaptive` its length follows acceptance, under the others it is fixed (RESULTS.md, issue 23: up to 6 drafts,
    adaptive, against a fixed 3)."""
    config = settings.draft_stop
    if settings.text_drafter:
        return DraftStopConfig("adaptive" if config.rule in ("auto", "adaptive") or config.adaptive else "fixed")
    return resolve(config, settings.use_cache, settings.processor.is_greedy)


GAMMA_RULE = "an integer >= 1, or auto"


def parse_gamma(text: str) -> int | None:
    """A /gamma or --gamma value: "auto" (None) or an integer >= 1 (ValueError otherwise)."""
    if text.strip().lower() == "auto":
        return None
    value = int(text)
    if value < 1:
        raise ValueError(f"gamma must be {GAMMA_RULE}, got {text!r}")
    return value


def untimed_gamma(settings: Settings) -> int:
    """The most drafts a round proposes where no cap is timed (NASD; speculative decoding unless `measures_cap`)."""
    return draft_cap.FALLBACK_CAP if settings.gamma is None else settings.gamma


def measures_cap(settings: Settings) -> bool:
    """Whether speculative decoding's `gamma auto` is this machine's measured cap now: the cache on and a rule the
    cap model holds for (sampling/draft_cap.py); elsewhere it is FALLBACK_CAP."""
    return settings.gamma is None and settings.use_cache and draft_cap.applies(draft_stop_now(settings),
                                                                              settings.processor.is_greedy)


def describe_gamma(settings: Settings) -> str:
    """"4"; "auto = 6"; "auto = 12 (timed here)" once timed or read from the cache folder."""
    if settings.gamma is not None:
        return str(settings.gamma)
    if not measures_cap(settings):
        return f"auto = {untimed_gamma(settings)}"
    if settings.measured_cap is None:
        return "auto = chosen at the next speculative answer"
    return f"auto = {settings.measured_cap} ({settings.cap_source})"
