"""What a model SPEC names: an embedded name, a local folder, a `.gguf` file (whole, or the first part of a split
one), a GGUF file on the hub or a Hugging Face id; and whether the hub can be reached at all."""

from __future__ import annotations

import difflib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from utils.models.cache_folder import expand
from utils.models.embedded_models import EMBEDDED
from utils.models.hub_gguf import is_hub_gguf
from utils.models.load_error import ModelLoadError
from utils.paths import path_kind, short_path


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "embedded" | "folder" | "gguf" | "hub" | "hub-gguf" (a GGUF file on the hub: utils/models/hub_gguf.py)
    value: str

    @property
    def offline(self) -> bool:
        return self.kind != "hub"


def parse_spec(spec: str | os.PathLike) -> ModelSpec:
    if not isinstance(spec, (str, os.PathLike)):
        raise ModelLoadError(f"a model is named by a string (an embedded name, a folder, a .gguf file or a Hugging "
                             f"Face id), got {type(spec).__name__}")
    text = os.fspath(spec).strip()
    if not text:
        raise ModelLoadError("empty model spec")
    if text.lower() in EMBEDDED:
        return ModelSpec("embedded", text.lower())
    path = expand(text, "no model at ")
    try:
        return local_spec(text, path)
    except OSError as error:  # a name longer than the system takes: `path_kind` raises it
        raise ModelLoadError(f"no model at {short_path(path)}: {error.strerror or error}") from None


def same_model(a: str, b: str) -> bool:
    """Whether two specs name one model: the same text, or the same file or folder spelled otherwise (a relative
    path, a link), so that a drafter named as the target is the target, not a second, lossy copy."""
    if a == b:
        return True
    try:
        first, second = parse_spec(a), parse_spec(b)
    except ModelLoadError:
        return False  # each load says what is wrong with its own
    if first.kind != second.kind or first.kind not in ("gguf", "folder"):
        return first == second  # an embedded name lower-cased, a hub id as written
    try:
        return os.path.samefile(first.value, second.value)
    except OSError:
        return False


def local_spec(text: str, path: Path) -> ModelSpec:
    """`parse_spec` for what is not an embedded name: a GGUF file, a folder, else a Hugging Face id."""
    kind = path_kind(path)
    if text.lower().endswith(".gguf"):
        if kind == "dir":
            raise ModelLoadError(f"{path} is a folder, not a GGUF file")
        if kind != "file":
            if kind is None and is_hub_gguf(text):
                return ModelSpec("hub-gguf", text)
            raise ModelLoadError(f"no GGUF file at {path}")
        # as given, not resolved: a split model's other parts lie beside the path named (a Hugging Face cache's
        # snapshot links each to a blob named by its hash), and the notes name that file
        return ModelSpec("gguf", os.path.abspath(path))
    if kind == "dir":
        return ModelSpec("folder", str(path.resolve()))
    if text.startswith((".", "/", "~")) or os.sep in text.strip("/").replace("/", "", 1):
        if kind == "file":
            raise ModelLoadError(f"{path} is a file, not a model folder; a GGUF model's file name ends in .gguf")
        raise ModelLoadError(f"no model folder at {path}")
    if "/" not in text and difflib.get_close_matches(text.lower(), EMBEDDED, n=1, cutoff=0.8):
        # near an embedded name and without an owner, as no repository of that family on the hub is named
        raise ModelLoadError(f"no embedded model, folder or file named {text!r}: the embedded ones are "
                             f"{', '.join(EMBEDDED)}; a Hugging Face id names its owner (Qwen/...)")
    return ModelSpec("hub-gguf" if kind is None and is_hub_gguf(text) else "hub", text)


def hub_reachable() -> bool:
    """Whether the Hugging Face endpoint's host name resolves. Offline, a hub id is read from the local Hugging
    Face cache alone, at once, instead of after five retries over ~25 s that end in the same error."""
    from urllib.parse import urlparse
    from urllib.request import getproxies

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if {"https", "all"} & set(getproxies()):
        return True  # a proxy resolves the name, where this machine may not
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except (OSError, UnicodeError):
        return False
    return True
