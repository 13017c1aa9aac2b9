"""`python -m benchmarks`: our generators against transformers' `generate()` and llama.cpp on the embedded pair.

Everything runs in one process on one machine: greedy decoding, warm models, `time.perf_counter()` around each
generation with the device synchronised, tokens/s = generated tokens (the prompt's not counted) / seconds of the
whole generation (the prompt's pass included; a second rate leaves it out), median over the repeats. Writes
`<out>/results.json`, `<out>/results.md` and `<out>/speedup.png`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from ngram_assisted import NGramStorage, nasd_run
from ngram_assisted.ngram_assisted import PICKY, REFERENCE
from ngram_assisted.ngram_prior import prior_fingerprint, shipped_prior
from sampling import DraftStopConfig, LoopSettings, autoregressive_run, make_draft_stop, speculative_run
from sampling import draft_cap
from benchmarks import llama_cpp_peer
from utils.models.draft_vocab import DEFAULT_DRAFT_VOCAB, use_draft_vocab
from utils.models.model_loader import (DEFAULT_DRAFTER, DEFAULT_TARGET, ModelLoadError, check_vocab_compatible,
                                      gguf_file, gguf_repository_name, load_model, parse_spec, precision_summary,
                                      resolve_device)
from utils.models.native_tree import transformers_form
from utils.chat.prompt_tokens import chat_ids, stop_tokens
from utils.model_runner import synchronize
from utils.chat.settings import describe_processor, parse_gamma, parse_processor
from benchmarks.cli import (at_least, count_list, guarded, in_turn, number, number_list, read_prompts, tool_parser,
                            writable_folder)

PROMPTS = Path(__file__).with_name("prompts.json")


@dataclass
class Run:
    """One method on one prompt. Counts are summed over the repeats (sampled, each repeat answers differently), so
    the summary's ratios are ratios of sums: acceptance = accepted / drafted, never a mean of per-prompt rates."""
    method: str  # e.g. "ours-ar", "ours-sd-g4", "hf-assisted", "llama-plain"; "-full" = with the full drafter
    group: str
    prompt: int
    cache: bool
    tokens: int  # generated, all repeats
    tokens_per_s: float  # median over repeats
    target_forwards: int | None  # our methods: target passes, all repeats
    same_as_ar: bool | None  # greedy output equal to our AR's on this prompt, in every repeat
    drafted: int | None = None  # our speculative methods, all repeats
    accepted: int | None = None
    rounds: int | None = None  # verification passes
    # median over repeats of the tokens after the first over the seconds after it: the prompt's pass left out, so
    # that two methods whose answers differ in length (ours and llama.cpp's) are held at the same thing
    decode_tokens_per_s: float | None = None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def drafts_per_round(self) -> float | None:
        return self.drafted / self.rounds if self.rounds else None


def draft_stop_of(method: str) -> DraftStopConfig | None:
    """The draft-stop rule of a method (ours-sd-learned, ours-sd-entropy-B), or None."""
    if method == "ours-sd-learned":
        return DraftStopConfig("learned")
    if method.startswith("ours-sd-entropy-"):
        return DraftStopConfig("entropy", entropy_bound=float(method.removeprefix("ours-sd-entropy-")))
    return None


# A full run's defaults, and --quick's where the command line gives none.
FULL = {"prompts_per_group": 4, "gammas": [1, 2, 3, 4, 5, 6, 7, 8], "repeats": 3, "cache_off_prompts": 1}
QUICK = {"prompts_per_group": 1, "gammas": [2, 4, 8], "repeats": 1, "cache_off_prompts": 0}


def parse_args(argv=None):
    p = tool_parser("benchmarks", __doc__)
    p.add_argument("--quick", action="store_true",
                   help="1 prompt per group, gammas 2,4,8, 1 repeat, no cache-off pass (where not given)")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default=DEFAULT_DRAFTER)
    p.add_argument("--dtype", default="auto", help="auto (GGUF on CPU: native), native, float32, ...")
    p.add_argument("--kernels", default="auto", help="native mode: auto, gguf, int4, bf16 or f32")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-onednn", dest="onednn", action="store_false",
                   help="keep torch's default float32 matmul on CPU instead of oneDNN linear layers")
    p.add_argument("--no-cheap-drafter", dest="cheap_drafter", action="store_false",
                   help="our methods draft with the drafter as loaded by default too (by default they use its cheap "
                        "copy as the CLI does: int4 in native mode, int8 in float32; ours-sd-full / hf-assisted-cheap "
                        "show each drafter in the other loop)")
    p.add_argument("--draft-vocab", type=at_least(0), default=None,
                   help="the cheap drafter's head over the N most frequent tokens and the conversation's, as the CLI "
                        f"(0: the full head; default {DEFAULT_DRAFT_VOCAB}; not with --no-cheap-drafter)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=64)
    p.add_argument("--gammas", type=count_list(1), default=None, help="the fixed draft lengths (default 1,2,3,4,5,6,7,8)")
    p.add_argument("--prompts-per-group", type=at_least(1), default=None, help="default 4")
    p.add_argument("--repeats", type=at_least(1), default=None, help="default 3")
    p.add_argument("--cache-off-prompts", type=at_least(0), default=None,
                   help="prompts per group also run with the cache off (default 1)")
    p.add_argument("--cache-off-tokens", type=at_least(1), default=32)
    p.add_argument("--confidence", type=number(lambda c: DraftStopConfig("confidence", confidence=c)),
                   default=DraftStopConfig().confidence,
                   help="ours-sd-confident stops a round's drafting after a draft below this top probability")
    p.add_argument("--entropy-bounds", type=number_list(lambda b: DraftStopConfig("entropy", entropy_bound=b)),
                   default=[DraftStopConfig().entropy_bound],
                   help="one ours-sd-entropy-B method per bound B in [0, 1) (--draft-stop entropy B), comma-separated "
                        "(default 0.5)")
    p.add_argument("--stop-gamma", type=cap_or_auto, default=None,
                   help="most drafts per round of the draft-stop methods (ours-sd-confident, -entropy-B, -learned): "
                        "a number, or auto: the chat's /gamma auto for each rule (greedy confidence >= 0.9: the cap "
                        f"timed on this machine; else {draft_cap.FALLBACK_CAP}); default: the largest of --gammas")
    p.add_argument("--processor", default="greedy",
                   help="as the CLI's, e.g. 'nucleus 0.7 0.9'; sampling runs only our methods, repeat i of each "
                        "from seed i")
    p.add_argument("--llama-sd-drafts", type=at_least(1), default=llama_cpp_peer.SD_DRAFTS,
                   help=f"llama-sd's drafts a round (default {llama_cpp_peer.SD_DRAFTS}; its hook has no stop rule)")
    p.add_argument("--prompts", default=str(PROMPTS), help="prompts by group (a sweep runs on train_prompts.json)")
    p.add_argument("--methods", default=None, help="comma-separated subset, e.g. ours-ar,ours-nasd (default: all)")
    p.add_argument("--groups", default=None, help="comma-separated subset of the prompt groups (default: all)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():  # --quick fills only what the command line leaves out
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.processor_obj = parse_processor(args.processor.split())
    except ValueError as error:
        p.error(f"--processor: {error}")
    args.stop_gamma = args.stop_gamma or max(args.gammas)
    if args.kernels != "auto" and args.dtype in ("float32", "bfloat16", "float16"):  # the run would be float's
        p.error(f"--kernels {args.kernels}: native mode's kernels; --dtype {args.dtype} runs none")
    if args.draft_vocab is not None and not args.cheap_drafter:  # only the cheap copy's head is narrowed
        p.error("--draft-vocab: applies to the cheap drafter, which --no-cheap-drafter turns off")
    args.draft_vocab = DEFAULT_DRAFT_VOCAB if args.draft_vocab is None else args.draft_vocab
    args.groups = narrow(p, "--groups", args.groups, list(read_prompts(p, args.prompts)))
    asked = set(names_in(args.methods or ""))
    missing = sorted(asked & set(llama_cpp_peer.METHODS))
    if missing and not llama_cpp_peer.available():
        p.error(f"--methods: {', '.join(missing)} need llama.cpp: {llama_cpp_peer.unavailable()}")
    try:
        parsed = parse_spec(args.target)
        gguf_target = parsed.kind in ("embedded", "gguf", "hub-gguf") or gguf_repository_name(parsed)
    except ModelLoadError as error:
        p.error(f"--target: {error}")
    if missing and not gguf_target:
        p.error(f"--methods: {', '.join(missing)} run llama.cpp on the target's GGUF file; {args.target} is none")
    args.methods = narrow(p, "--methods", args.methods,
                          method_names(args.gammas, args.cheap_drafter, llama=None if gguf_target else False,
                                       bounds=args.entropy_bounds))
    args.methods_asked = args.methods if asked else []  # the rest are defaults, dropped where they cannot run
    if not args.methods_asked and gguf_target and not llama_cpp_peer.available():  # else "vs llama.cpp" is "-"
        print(f"llama.cpp's methods left out: {llama_cpp_peer.unavailable()}", file=sys.stderr)
    peers = [m for m in args.methods if m in llama_cpp_peer.METHODS]
    if peers:  # llama.cpp runs on the CPU (n_gpu_layers 0): beside ours on a GPU, "vs llama.cpp" held two devices
        try:
            device = resolve_device(args.device)
        except ModelLoadError as error:
            p.error(f"--device: {error}")
        if device != "cpu":
            if set(peers) & asked:
                p.error(f"--methods: {', '.join(peers)} run llama.cpp on the CPU, ours on {device}: give --device cpu")
            print(f"{', '.join(peers)} left out: llama.cpp runs on the CPU, ours on {device} (--device cpu runs them)",
                  file=sys.stderr)
            args.methods = [m for m in args.methods if m not in peers]
    if not args.processor_obj.is_greedy and any(not m.startswith("ours-") for m in args.methods):
        p.error("--processor: sampling compares our methods only (give --methods ours-...)")
    args.out = str(writable_folder(p, "--out", args.out))  # last: a refused command leaves no folder behind
    return args


def cap_or_auto(text: str) -> int | str:
    """--stop-gamma: an integer >= 1, or auto (resolved once the models are loaded: `Bench.caps_for`); the chat's
    /gamma rule (`parse_gamma`)."""
    try:
        value = parse_gamma(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or auto, got {text!r}") from None
    return "auto" if value is None else value


def describe_caps(caps: dict[str, int]) -> str:
    """{"ours-sd-confident": 12, "ours-sd-learned": 6} -> "confident at most 12 drafts a round, learned at most 6"."""
    by_cap: dict[int, list[str]] = {}
    for method, cap in caps.items():
        by_cap.setdefault(cap, []).append(method.removeprefix("ours-sd-"))
    return ", ".join(f"{'/'.join(methods)} at most {cap}" + (" drafts a round" if i == 0 else "")
                     for i, (cap, methods) in enumerate(by_cap.items()))


def narrow(p: argparse.ArgumentParser, flag: str, value: str | None, known: list[str]) -> list[str]:
    """The comma-separated subset `value` of `known`, in `known`'s order (all of it when None); unknown names
    end the program before minutes of model loading."""
    if value is None:
        return known
    chosen = names_in(value)
    if not chosen:
        p.error(f"{flag}: no name in {value!r}; known: {', '.join(known)}")
    if set(chosen) - set(known):
        p.error(f"{flag}: unknown {', '.join(sorted(set(chosen) - set(known)))}; known: {', '.join(known)}")
    return [name for name in known if name in chosen]


def names_in(value: str) -> list[str]:
    """The names of a comma-separated list, stripped, empty ones dropped (a trailing comma is a typo, not a name); an
    entropy method as its canonical name, so that `ours-sd-entropy-0.50` is `ours-sd-entropy-0.5`."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    return [canonical_entropy_name(name) for name in names]


def entropy_method(bound: float) -> str:
    """The method of an entropy bound: its shortest exact decimal (repr), so that two bounds never share a name."""
    return f"ours-sd-entropy-{bound!r}"


def canonical_entropy_name(name: str) -> str:
    if name.startswith("ours-sd-entropy-"):
        try:
            return entropy_method(float(name.removeprefix("ours-sd-entropy-")))
        except ValueError:
            pass  # not a number: left as given, for narrow's "unknown"
    return name


def method_names(gammas: list[int], cheap_drafter: bool, llama: bool | None = None,
                 bounds: list[float] = (0.5,)) -> list[str]:
    """Every method of a run, in table order; the crossed drafter methods need both drafters, llama.cpp's
    methods the optional llama-cpp-python."""
    every = (["ours-ar"] + [f"ours-sd-g{g}" for g in gammas] + ["ours-sd-adaptive", "ours-sd-confident",
             *[entropy_method(b) for b in bounds], "ours-sd-learned", "ours-sd-full", "ours-nasd",
             "ours-nasd-prior", "ours-nasd-follow", "ours-nasd-ref", "hf-generate", "hf-assisted", "hf-assisted-cheap", "hf-prompt-lookup", *llama_cpp_peer.METHODS])
    if not cheap_drafter:
        every = [m for m in every if m not in ("ours-sd-full", "hf-assisted-cheap")]
    if not (llama_cpp_peer.available() if llama is None else llama):
        every = [m for m in every if m not in llama_cpp_peer.METHODS]
    return every


class Bench:
    def __init__(self, args):
        self.args = args
        load = dict(device=args.device, dtype=args.dtype, onednn=args.onednn, kernels=args.kernels)
        self.target, self.tokenizer = load_model(args.target, **load)
        # The drafter as loaded by default (same mode and kernels as the target) for hf-assisted, and the cheap
        # copy our CLI drafts with; the two extra methods cross them over, to tell loop from drafter.
        crossed = {"ours-sd-full", "hf-assisted"} & set(args.methods)  # the only users of the full drafter
        self.full_drafter, drafter_tokenizer = (load_model(args.drafter, **load) if crossed or not args.cheap_drafter
                                                else (None, None))
        self.drafter = self.full_drafter
        self.draft_vocab = ""
        if args.cheap_drafter:
            self.drafter, drafter_tokenizer = load_model(args.drafter, **load, int8=True, int4_drafter=True)
            self.draft_vocab = use_draft_vocab(self.drafter, drafter_tokenizer, args.draft_vocab)
        self.translated = self.translation(drafter_tokenizer)
        self.stop = stop_tokens(self.tokenizer, self.target, chat=True)  # the prompts go through the chat template
        # One rule per draft-stop method for the whole run, as a chat keeps it: a learned rule's measurements carry.
        self.stop_rules = {}
        for method in list(args.methods):
            if (config := draft_stop_of(method)) is None:
                continue
            try:
                self.stop_rules[method] = make_draft_stop(config, self.drafter)
            except ValueError as error:  # the shipped head was trained for another drafter
                self.cannot_run(method, str(error))
        self.processor = args.processor_obj
        self.stop_caps = self.caps_for(args.stop_gamma)
        # ours-nasd-prior: the chat's NASD, which also drafts from the prior shipped for this tokenizer
        self.prior = None
        if "ours-nasd-prior" in args.methods:
            self.prior = shipped_prior(prior_fingerprint(self.tokenizer), self.target.config.vocab_size)
            if self.prior is None:
                self.cannot_run("ours-nasd-prior", "no prior is shipped for this target's tokenizer "
                                "(python -m benchmarks.ngram_prior build makes one)")
        self.llama = None
        if any(m in llama_cpp_peer.METHODS for m in args.methods):
            drafter = gguf_file(args.drafter) if "llama-sd" in args.methods else None
            self.llama = llama_cpp_peer.LlamaPeer(gguf_file(args.target), drafter, sd_drafts=args.llama_sd_drafts)

    def translation(self, drafter_tokenizer):
        """The drafter's tokenizer where its vocabulary differs from the target's, else None. Such a drafter drafts
        in its own tokens, translated through text, as the chat's does (`--drafter` of another family): fed the
        target's ids instead, it would read other tokens and its drafts would be noise. Only fixed and adaptive
        draft lengths translate; llama.cpp's draft hook takes the target's ids."""
        try:
            check_vocab_compatible(self.target, self.tokenizer, self.drafter, drafter_tokenizer)
            return None
        except ModelLoadError:
            pass
        for method in list(self.args.methods):
            if method in ("ours-sd-confident", "llama-sd") or draft_stop_of(method) is not None:
                self.cannot_run(method, "the drafter's vocabulary differs from the target's: its drafts are "
                                "translated, with a fixed or adaptive length (ours-sd-gN, ours-sd-adaptive)")
        return drafter_tokenizer

    def caps_for(self, asked: int | str) -> dict[str, int]:
        """Each draft-stop method's most drafts a round: `asked`; under `auto`, what the chat's /gamma auto gives
        its rule (Session.gamma_for): the cap timed on this machine (or read from the cache folder, before any
        clock runs) where the cap model holds, greedy confidence >= 0.9 (`draft_cap.applies`), else FALLBACK_CAP."""
        rules = {m: DraftStopConfig("confidence", confidence=self.args.confidence) if m == "ours-sd-confident"
                 else draft_stop_of(m) for m in self.args.methods}
        rules = {m: rule for m, rule in rules.items() if rule is not None}
        if asked != "auto":
            return {m: asked for m in rules}
        timed = [m for m, rule in rules.items() if draft_cap.applies(rule, self.processor.is_greedy)]
        if not timed:
            return {m: draft_cap.FALLBACK_CAP for m in rules}
        cap, costs = draft_cap.load_or_measure(self.target, self.drafter, note=print)
        print(f"--stop-gamma auto: {', '.join(timed)} at most {cap} drafts ({costs.describe()})")
        return {m: cap if m in timed else draft_cap.FALLBACK_CAP for m in rules}

    def cannot_run(self, method: str, why: str) -> None:
        """A method that cannot run with these models: refused where it was asked for, else left out with a line."""
        if method in self.args.methods_asked:
            raise SystemExit(f"{method}: {why}")
        print(f"{method} left out: {why}", file=sys.stderr)
        self.args.methods.remove(method)

    def encode(self, prompt: str) -> list[int]:
        return chat_ids(self.tokenizer, prompt)  # as the CLI encodes a first chat turn

    def timed(self, fn, first: list = ()):
        """fn()'s result, its seconds and (seconds, tokens) at its first token(s), which `fn` puts in `first` as
        (clock, tokens), or None where it did not."""
        synchronize(self.target.device)
        start = time.perf_counter()
        out = fn()
        synchronize(self.target.device)
        seconds = time.perf_counter() - start
        return out, seconds, (first[0][0] - start, first[0][1]) if first else None

    def ours(self, method: str, ids: list[int], cache: bool, n: int, on_round=None):
        loop = LoopSettings(max_gen_len=n, gamma=0, eos_tokens_id=self.stop)
        processor = self.processor

        def sd(drafter, gamma: int, **rule):  # a speculative method: its drafter, its most drafts, its stop rule
            loop.gamma = gamma
            translated = dict(tokenizer=self.tokenizer, drafter_tokenizer=self.translated) if self.translated else {}
            return speculative_run(ids, drafter, self.target, processor, loop, cache, on_round=on_round, **rule,
                                   **translated)

        if method == "ours-ar":
            return autoregressive_run(ids, self.target, n, processor, self.stop, cache, on_round=on_round)
        if method == "ours-sd-full":
            return sd(self.full_drafter, max(self.args.gammas))
        if method.startswith("ours-sd-g"):
            return sd(self.drafter, int(method.removeprefix("ours-sd-g")))
        if method in self.stop_rules:
            return sd(self.drafter, self.stop_caps[method], draft_stop=self.stop_rules[method])
        if method == "ours-sd-adaptive":
            return sd(self.drafter, max(self.args.gammas), adaptive_gamma=True)
        if method == "ours-sd-confident":
            return sd(self.drafter, self.stop_caps[method], confidence=self.args.confidence)
        loop.gamma = 8
        # ours-nasd: the chat's policy for the cache setting (`policy_for`); ours-nasd-follow: the cache-on one with
        # the +2/-1 draft length it had before DoublingLength
        policy = {"ours-nasd-ref": REFERENCE, "ours-nasd-follow": replace(PICKY, length="follow")}.get(method)
        return nasd_run(ids, NGramStorage(4, self.target.config.vocab_size), self.target, processor, loop,
                        filler_top_k=3, use_cache=cache, policy=policy, on_round=on_round,
                        prior=self.prior if method == "ours-nasd-prior" else None)

    def hf(self, method: str, ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids], device=self.target.device)
        # repetition_penalty: transformers applies a model's own (1.1 in some hub configs) even to greedy decoding
        kwargs = dict(max_new_tokens=n, do_sample=False, eos_token_id=self.stop, pad_token_id=self.stop[0],
                      repetition_penalty=1.0)
        if method in ("hf-assisted", "hf-assisted-cheap"):
            assistant = self.full_drafter if method == "hf-assisted" else self.drafter
            kwargs["assistant_model"] = transformers_form(assistant)
            if self.translated is not None:  # transformers' universal assisted decoding, through text as ours
                kwargs.update(tokenizer=self.tokenizer, assistant_tokenizer=self.translated)
        elif method == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = 10
        with torch.no_grad():
            return transformers_form(self.target).generate(x, **kwargs)[0, len(ids):].tolist()

    def once(self, method: str, ids: list[int], cache: bool, n: int, seed: int = 0):
        """One timed generation -> (tokens, seconds, our GenerationResult or None for transformers' methods, first):
        `first` is (seconds, tokens) at the end of the prompt's pass, or None for transformers' methods (no hook).
        Sampled, a repeat's methods share `seed` and each repeat has its own, so repeats weigh several answers."""
        torch.manual_seed(seed)
        first: list[tuple[float, int]] = []

        def mark(round_=None) -> None:  # the first round: the prompt read, its first token(s) out
            if not first:
                first.append((time.perf_counter(), 1 if round_ is None else len(round_.tokens)))

        if method in llama_cpp_peer.METHODS:
            tokens, seconds, to_first = self.timed(lambda: self.llama.generate(method, ids, n, self.stop, mark), first)
            return tokens, seconds, self.llama.counts(method, tokens), to_first  # counts: None for llama-plain
        if method.startswith("hf-"):
            return *self.timed(lambda: self.hf(method, ids, n))[:2], None, None
        result, seconds, to_first = self.timed(lambda: self.ours(method, ids, cache, n, mark), first)
        return result.tokens, seconds, result, to_first

    def prompt_runs(self, group: str, index: int, ids: list[int], cache: bool, n: int, methods: list[str],
                    bar, turn: int = 0) -> list[Run]:
        """All methods on one prompt, repeats interleaved (method by method within each repeat, every other repeat
        in reverse order), so that a slow stretch of the machine, or whatever the method before leaves behind, hits
        every method alike rather than one method's repeats."""
        # The first pass over a new prompt length ran slow (likely kernel set-up for its shapes: target prefill
        # at L tokens, the drafter's at L+1); 3 untimed tokens per method keep it out of whichever method runs first.
        for method in methods:
            self.once(method, ids, cache, 3)
        speeds: dict[str, list[float]] = {m: [] for m in methods}
        decoding: dict[str, list[float]] = {m: [] for m in methods}  # after the prompt's pass
        answers: dict[str, list] = {m: [] for m in methods}  # (tokens, result) of each repeat
        for repeat in range(self.args.repeats):
            # `turn`: this prompt's place in the run, so that one repeat a prompt alternates the order too
            for method in in_turn(methods, repeat + turn):
                tokens, seconds, result, first = self.once(method, ids, cache, n, seed=repeat)
                speeds[method].append(len(tokens) / seconds)
                if first is not None and len(tokens) > first[1]:
                    decoding[method].append((len(tokens) - first[1]) / (seconds - first[0]))
                answers[method].append((tokens, result))
                bar.update()
        greedy = self.processor.is_greedy
        return [prompt_run(method, group, index, cache, statistics.median(speeds[method]), answers, greedy,
                           statistics.median(decoding[method]) if decoding[method] else None)
                for method in methods]

    def run(self) -> list[Run]:
        groups = {g: p for g, p in read_prompts(None, self.args.prompts).items() if g in self.args.groups}
        jobs = []  # (group, prompt index, prompt, cache, new tokens, methods)
        for group, prompts in groups.items():
            for i, prompt in enumerate(prompts[: self.args.prompts_per_group]):
                jobs.append((group, i, prompt, True, self.args.max_new_tokens, self.args.methods))
        for group, prompts in groups.items():
            gamma = 4 if 4 in self.args.gammas else self.args.gammas[0]
            off = [m for m in ("ours-ar", f"ours-sd-g{gamma}", "ours-nasd", "ours-nasd-prior") if m in self.args.methods]
            for i, prompt in enumerate(prompts[: self.args.cache_off_prompts]):
                jobs.append((group, i, prompt, False, self.args.cache_off_tokens, off))
        warm = self.encode("Hello")
        for m in self.args.methods:  # one-time costs (first touches of the weights, kernel set-up) out of the figures
            self.once(m, warm, True, 8)
        runs = []
        with tqdm(total=sum(len(job[-1]) for job in jobs) * self.args.repeats, desc="benchmark", file=sys.stderr) as bar:
            for turn, (group, i, prompt, cache, n, methods) in enumerate(jobs):
                runs += self.prompt_runs(group, i, self.encode(prompt), cache, n, methods, bar, turn)
        return runs


def prompt_run(method: str, group: str, index: int, cache: bool, speed: float, answers: dict[str, list],
               greedy: bool, decode_speed: float | None = None) -> Run:
    """A method's repeats on one prompt (`answers[method]`: (tokens, our GenerationResult or None) a repeat) as
    one Run, counts summed over the repeats; greedy, its output is AR's if every repeat's is."""
    mine = answers[method]
    results = [result for _, result in mine if result is not None]
    drafting = bool(results) and method != "ours-ar"  # our SD and NASD methods

    def total(field: str) -> int | None:
        return sum(getattr(r, field) for r in results) if drafting else None

    same = None
    reference = "llama-plain" if method in llama_cpp_peer.METHODS else "ours-ar"  # llama.cpp's own kernels' AR
    if greedy and reference in answers and method != reference:
        same = all(tokens == expected for (tokens, _), (expected, _) in zip(mine, answers[reference]))
    return Run(method, group, index, cache, sum(len(tokens) for tokens, _ in mine), speed,
               sum(r.target_calls for r in results) if results else None, same,
               total("drafted"), total("accepted"), total("rounds"), decode_speed)


def summarise(runs: list[Run]) -> list[dict]:
    """Per method, group and cache setting: medians over prompts, and speedups over our AR and over generate()."""
    rows = []
    order = {m: i for i, m in enumerate(dict.fromkeys(r.method for r in runs))}  # the order they ran in
    groups = {g: i for i, g in enumerate(dict.fromkeys(r.group for r in runs))}
    keys = sorted({(r.cache, r.group, r.method) for r in runs}, key=lambda k: (not k[0], groups[k[1]], order[k[2]]))
    for cache, group, method in keys:
        sel = [r for r in runs if (r.cache, r.group, r.method) == (cache, group, method)]
        base = {r.prompt: r.tokens_per_s for r in runs if (r.cache, r.group, r.method) == (cache, group, "ours-ar")}
        hf = {r.prompt: r.tokens_per_s for r in runs if (r.cache, r.group, r.method) == (cache, group, "hf-generate")}
        llama = {r.prompt: r.tokens_per_s for r in runs
                 if (r.cache, r.group, r.method) == (cache, group, "llama-plain")}
        llama_decoding = {r.prompt: r.decode_tokens_per_s for r in runs if r.decode_tokens_per_s
                          and (r.cache, r.group, r.method) == (cache, group, "llama-plain")}
        decoding = [r for r in sel if r.decode_tokens_per_s]
        counted = [r for r in sel if r.target_forwards is not None]  # ours; ratios of sums over the prompts
        tokens, forwards = sum(r.tokens for r in counted), sum(r.target_forwards for r in counted)
        drafted = sum(r.drafted or 0 for r in sel)
        rounds = sum(r.rounds or 0 for r in sel)
        rows.append({
            "cache": cache, "group": group, "method": method,
            "tokens_per_s": statistics.median(r.tokens_per_s for r in sel),
            "acceptance_rate": sum(r.accepted or 0 for r in sel) / drafted if drafted else None,
            "drafts_per_round": drafted / rounds if rounds else None,
            "tokens_per_target_forward": tokens / forwards if forwards else None,
            "target_forwards_per_token": forwards / tokens if forwards and tokens else None,
            "speedup_vs_ours_ar": statistics.median(r.tokens_per_s / base[r.prompt] for r in sel if r.prompt in base)
            if base else None,
            "speedup_vs_generate": statistics.median(r.tokens_per_s / hf[r.prompt] for r in sel if r.prompt in hf)
            if hf else None,
            "same_as_ar": "-" if method in ("ours-ar", "llama-plain") or all(r.same_as_ar is None for r in sel)
            else f"{sum(bool(r.same_as_ar) for r in sel)}/{len(sel)}",
            "speedup_vs_llama": statistics.median(r.tokens_per_s / llama[r.prompt] for r in sel if r.prompt in llama)
            if llama else None,
            "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in decoding) if decoding else None,
            "decode_vs_llama": statistics.median(r.decode_tokens_per_s / llama_decoding[r.prompt] for r in decoding
                                                 if r.prompt in llama_decoding)
            if any(r.prompt in llama_decoding for r in decoding) else None,
        })
    return rows


def prompts_run(runs: list[Run], cache: bool) -> int | dict[str, int]:
    """Prompts a group that ran (a file may hold fewer than asked): one number, or one per group where they differ."""
    per_group = {g: len({r.prompt for r in runs if r.group == g and r.cache == cache})
                 for g in dict.fromkeys(r.group for r in runs)}
    counts = set(per_group.values())
    return counts.pop() if len(counts) == 1 else per_group


def per_group(count: int | dict[str, int]) -> str:
    return str(count) if isinstance(count, int) else ", ".join(f"{g} {n}" for g, n in count.items())


def fmt(value, pattern="{:.2f}"):
    return "–" if value is None else pattern.format(value)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Machine: {meta['machine']}; {meta['target']} + {meta['drafter']}, {meta['dtype']}, "
             f"{meta.get('processor', 'greedy')}, "
             f"{meta['max_new_tokens']} new tokens (cache off: {meta['cache_off_tokens']}), "
             f"{per_group(meta['prompts_per_group'])} prompt(s) per group, median of {meta['repeats']} repeat(s)"
             + (f"; {describe_caps(meta['stop_caps'])}" if meta.get('stop_caps') else "")
             + (f"; {meta['llama_cpp']}" if meta.get('llama_cpp') else "")
             + ".", "",
             "| cache | group | method | tokens/s | acceptance | drafts / round | tokens / target forward "
             "| target forwards / token | vs our AR | vs generate() | vs llama.cpp "
             "| output = AR (llama.cpp: = llama-plain) | after the first token: tokens/s | vs llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {'on' if r['cache'] else 'off'} | {r['group']} | {r['method']} | {fmt(r['tokens_per_s'])} | "
                     f"{fmt(r['acceptance_rate'], '{:.0%}')} | {fmt(r.get('drafts_per_round'), '{:.1f}')} | "
                     f"{fmt(r['tokens_per_target_forward'])} | "
                     f"{fmt(r['target_forwards_per_token'])} | {fmt(r['speedup_vs_ours_ar'], '{:.2f}x')} | "
                     f"{fmt(r['speedup_vs_generate'], '{:.2f}x')} | {fmt(r.get('speedup_vs_llama'), '{:.2f}x')} | "
                     f"{r['same_as_ar']} | {fmt(r.get('decode_tokens_per_s'))} | "
                     f"{fmt(r.get('decode_vs_llama'), '{:.2f}x')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], gammas: list[int], path: Path, processor: str = "greedy") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for group in sorted({r["group"] for r in rows if r["cache"]}):
        by = {r["method"]: r for r in rows if r["cache"] and r["group"] == group}
        xs = [g for g in gammas if f"ours-sd-g{g}" in by]
        line, = ax.plot(xs, [by[f"ours-sd-g{g}"]["speedup_vs_ours_ar"] for g in xs], marker="o",
                        label=f"speculative, {group}")
        for method, style in (("ours-sd-confident", (0, (5, 1, 1, 1, 1, 1))), ("ours-nasd", "--"), ("hf-assisted", ":"),
                              ("hf-assisted-cheap", (0, (1, 3))), ("hf-prompt-lookup", "-."),
                              ("llama-plain", (0, (3, 1))), ("llama-lookup", (0, (3, 1, 1, 1)))):
            if method in by and by[method]["speedup_vs_ours_ar"] is not None:
                ax.axhline(by[method]["speedup_vs_ours_ar"], linestyle=style, color=line.get_color(), alpha=0.7,
                           label=f"{method}, {group}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("gamma (drafts per round)")
    ax.set_ylabel("speedup over our autoregressive")
    ax.set_title(f"{processor[:1].upper()}{processor[1:]}, cache on")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    bench = Bench(args)
    runs = bench.run()
    rows = summarise(runs)
    meta = {"machine": machine(), "target": args.target,
            "drafter": args.drafter + (f" ({precision_summary(bench.drafter)}, cheap copy"
                                       + (f", {bench.draft_vocab}" if bench.draft_vocab else "")
                                       + (f"; {precision_summary(bench.full_drafter)} for -full and hf-assisted"
                                          if bench.full_drafter is not None else "") + ")"
                                       if args.cheap_drafter else "")
                       + ("; another vocabulary: drafts translated through text" if bench.translated else ""),
            "dtype": precision_summary(bench.target) + (" + oneDNN linear" if args.onednn and "native" not in
                                                        precision_summary(bench.target) else ""),
            "max_new_tokens": args.max_new_tokens, "processor": describe_processor(args.processor_obj),
            "prompts": Path(args.prompts).name,
            "cache_off_tokens": args.cache_off_tokens, "prompts_per_group": prompts_run(runs, True),
            "cache_off_prompts_per_group": prompts_run(runs, False),
            "repeats": args.repeats, "gammas": args.gammas, "stop_caps": bench.stop_caps,
            "llama_cpp": bench.llama.describe() if bench.llama is not None else None,
            "command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": [asdict(r) for r in runs]},
                                                 indent=1))
    (out / "results.md").write_text(markdown(rows, meta))
    try:
        plot(rows, args.gammas, out / "speedup.png", meta["processor"])
    except ImportError:  # matplotlib is the optional [bench] extra; the figures are written
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
    print(markdown(rows, meta))
    if broken := lossless_failures(runs):  # after the files are written, for a look at what differed
        raise SystemExit(f"greedy output differs from ours-ar: {'; '.join(broken)}")


def lossless_failures(runs: list[Run]) -> list[str]:
    """Our greedy methods whose output differs from our AR's: a broken lossless claim ends the run in an error."""
    return [f"{r.method} on {r.group} prompt {r.prompt}, cache {'on' if r.cache else 'off'}" for r in runs
            if r.method.startswith("ours-") and r.same_as_ar is False]


def machine() -> str:
    """The CPU of every figure (its model, torch's capability, /proc/cpuinfo's flags, threads), after the GPU where
    torch sees one: a GPU run's loop, tokenizer and llama.cpp's peers run on the CPU."""
    import os

    from utils.models import qkernels
    from utils.models.kernel_choice import describe_cpu

    cpu = f"{describe_cpu()}, {os.cpu_count()} cores, {qkernels.describe()}"
    return f"{torch.cuda.get_device_name(0)}; CPU {cpu}" if torch.cuda.is_available() else cpu


if __name__ == "__main__":
    guarded(main)
