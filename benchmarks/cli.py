"""What the benchmarks' command lines share: counts checked as argparse reads them, an output folder checked before
minutes of loading, and a run whose expected failures (a model that does not load, a file that cannot be read, a
value a library refuses) end in one line instead of a traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from utils.models.load_error import ModelLoadError
from utils.printing import one_line


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
        return values

    parse.__name__ = f"integers >= {low}"
    return parse


def writable_folder(parser: argparse.ArgumentParser, flag: str, path: str) -> Path:
    """`path` made (with its parents) and writable, or the parser's one-line error: before the run, whose results
    an unwritable folder would otherwise lose at its end."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"{flag}: cannot make {folder}: {error.strerror or one_line(error)}")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"{flag}: cannot write in {folder}")
    return folder


def read_prompts(parser: argparse.ArgumentParser | None, path: str) -> dict[str, list[str]]:
    """A prompt file: a JSON object of group -> list of prompts. What is wrong with it is the parser's one-line
    error (a ValueError without a parser)."""
    try:
        groups = json.loads(Path(path).read_text(encoding="utf-8"))
        if not (isinstance(groups, dict) and groups and all(
                isinstance(prompts, list) and all(isinstance(p, str) for p in prompts) for prompts in groups.values())):
            raise ValueError("expected a JSON object of prompt groups, each a list of strings")
    except OSError as error:
        problem = f"cannot read {path}: {error.strerror or one_line(error)}"
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError included
        problem = f"{path}: {one_line(error)}"
    else:
        return groups
    if parser is None:
        raise ValueError(problem)
    parser.error(f"--prompts: {problem}")


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
    except (ModelLoadError, OSError, ValueError, RuntimeError) as error:
        if os.environ.get("SPECDEC_TRACEBACK"):
            raise
        kind = "" if isinstance(error, ModelLoadError) else f"{type(error).__name__}: "
        raise SystemExit(f"{prog}: {kind}{one_line(error)}") from None
