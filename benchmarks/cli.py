"""What the benchmarks' command lines share: counts checked as argparse reads them, an output folder checked before
minutes of loading, and a run whose expected failures (a model that does not load, a file that cannot be read, a
value a library refuses) end in one line instead of a traceback."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from utils.models.load_error import ModelLoadError
from utils.paths import expand_user, short_path, unwritable
from utils.printing import one_line


def in_turn(methods: list[str], repeat: int) -> list[str]:
    """The order of a prompt's methods in one repeat: as listed, then reversed, so drift weighs on all alike."""
    return methods if repeat % 2 == 0 else methods[::-1]


# --repeats of the tools whose contenders take turns (every other turn reversed): with an odd count the first-listed
# goes first once more than the others, so the defaults are even and a user's odd count says so here.
EVEN = "timed turns, every other one reversed: an even count puts each contender first in half of them"


def tool_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """A benchmark tool's parser: its usage names the command that runs it (`python -m benchmarks.x`; the file
    alone cannot import the project), and `--help` shows the module's whole docstring as written."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def count_list(low: int = 1) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each >= `low` (gammas, widths, row counts)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or min(values) < low:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {low}, got {text!r}")
        return list(dict.fromkeys(values))  # a value given twice is run once

    parse.__name__ = f"integers >= {low}"
    return parse


def random_seed(text: str) -> int:
    """An argparse type: a seed torch takes (the chat's /seed range), refused before the minutes a run collects."""
    from utils.chat.commands import SEEDS

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not SEEDS[0] <= value <= SEEDS[1]:
        raise argparse.ArgumentTypeError(f"expected an integer from -2**63 to 2**64-1, got {text!r}")
    return value


def choice_list(known) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated subset of the names `known`, in the order given, each once."""

    def parse(text: str) -> list[str]:
        names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or repr(text)}; known: {', '.join(known)}")
        return names

    parse.__name__ = "names"
    return parse


def checked_number(text: str, check: Callable[[float], object]) -> float:
    """`text` as a number that `check` accepts (it raises ValueError with the reason), or argparse's error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    try:
        check(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(one_line(error)) from None
    return value


def number(check: Callable[[float], object]) -> Callable[[str], float]:
    """An argparse type: one number accepted by `check`: a bound refused before any model loads."""

    def parse(text: str) -> float:
        return checked_number(text, check)

    parse.__name__ = "number"
    return parse


def number_list(check: Callable[[float], object]) -> Callable[[str], list[float]]:
    """An argparse type: comma-separated numbers, each accepted by `check`, a value given twice kept once."""

    def parse(text: str) -> list[float]:
        values = [checked_number(v, check) for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
        return list(dict.fromkeys(values))

    parse.__name__ = "numbers"
    return parse


def user_path(parser: argparse.ArgumentParser, flag: str, path: str) -> Path:
    """`path` with `~` expanded as a shell would have (`--out=~/x` and a quoted `'~/x'` reach us unexpanded); an
    empty one refused (`Path("")` is the current folder: `--out ''` wrote the results there without a word)."""
    if not path.strip():
        parser.error(f"{flag}: empty; give a path")
    try:
        return expand_user(path)
    except ValueError as error:
        parser.error(f"{flag}: {error}")


def writable_folder(parser: argparse.ArgumentParser, flag: str, path: str) -> Path:
    """`path` made (with its parents) and writable, or the parser's one-line error: before the run, whose results
    an unwritable folder would otherwise lose at its end."""
    folder = user_path(parser, flag, path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"{flag}: cannot make {short_path(folder)}: {error.strerror or one_line(error)}")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"{flag}: cannot write in {short_path(folder)}")
    return folder


def writable_file(parser: argparse.ArgumentParser, flag: str, path: str) -> Path:
    """`path` as a file the run can write at its end (its folder made and writable, no folder in its place), or
    the parser's one-line error before the run."""
    file = user_path(parser, flag, path)
    writable_folder(parser, flag, str(file.parent))
    if problem := unwritable(str(file)):
        parser.error(f"{flag}: {problem}")
    return file


def read_prompts(parser: argparse.ArgumentParser | None, path: str, flag: str = "--prompts") -> dict[str, list[str]]:
    """A prompt file: a JSON object of group -> list of prompts. What is wrong with it is the parser's one-line
    error (a ValueError without a parser)."""
    try:
        if not path.strip():  # else "cannot read : Is a directory" (the current folder)
            raise ValueError("empty; give a path")
        groups = json.loads(expand_user(path).read_text(encoding="utf-8"))
        if not (isinstance(groups, dict) and groups and all(
                isinstance(prompts, list) and all(isinstance(p, str) for p in prompts) for prompts in groups.values())):
            raise ValueError("expected a JSON object of prompt groups, each a list of strings")
        empty = [group for group, prompts in groups.items() if not prompts]
        if empty:  # a group of no prompts would run every model's warm-up, then write an empty table
            raise ValueError(f"{'groups' if len(empty) > 1 else 'group'} {', '.join(map(repr, empty))} "
                             f"{'have' if len(empty) > 1 else 'has'} no prompts")
    except OSError as error:
        problem = f"cannot read {path}: {error.strerror or one_line(error)}"
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError included
        problem = f"{path}: {one_line(error)}" if path.strip() else one_line(error)
    else:
        return groups
    if parser is None:
        raise ValueError(problem)
    parser.error(f"{flag}: {problem}")


def acceptance(accepted: int, drafted: int) -> str:
    """Accepted drafts as a share of the drafted; "–" where nothing was drafted: undefined, not 0% (the chat's
    report and `python -m benchmarks` say so too)."""
    return "–" if drafted == 0 else f"{accepted / drafted:.0%}"


def guarded(main: Callable[[], object]) -> None:
    """Runs a benchmark's `main`; a model that does not load, a file it cannot read or a value a library refuses is
    one line on stderr and exit status 1 (SPECDEC_TRACEBACK=1 shows the traceback)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    prog = f"python -m {spec.name.removesuffix('.__main__')}" if spec is not None else "benchmark"
    try:
        main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except (ModelLoadError, OSError, ValueError, RuntimeError, subprocess.SubprocessError) as error:
        if os.environ.get("SPECDEC_TRACEBACK"):
            raise
        kind = "" if isinstance(error, ModelLoadError) else f"{type(error).__name__}: "
        raise SystemExit(f"{prog}: {kind}{one_line(error)}") from None
