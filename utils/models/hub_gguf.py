"""GGUF files on the Hugging Face hub, named as llama.cpp's `-hf` names them: `owner/repo:QUANT` (the repository's
one file, or split model, with QUANT in its name: `Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:q4_k_m`) or
`owner/repo/FILE.gguf` (a file by its path in the repository). The file is downloaded into the Hugging Face
cache (its progress bar, its resumable downloads), every part of a split model with it, then runs as a local
`.gguf` file: at its own precision on the CPU. Offline, the cache alone answers.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from utils.models.gguf_header import SPLIT_NAME
from utils.models.load_error import ModelLoadError

# owner/repo:QUANT: the hub's names are letters, digits, '-', '_' and '.'
QUANT_SPEC = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+):(?P<quant>[\w.-]+)")
FILE_SPEC = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)/(?P<file>[^:]+\.gguf)", re.IGNORECASE)


def is_hub_gguf(text: str) -> bool:
    """Whether `text`, which is no local file or folder, names a GGUF file on the hub: not where its first folder
    exists here (a mistyped local path is said as one)."""
    if not (QUANT_SPEC.fullmatch(text) or FILE_SPEC.fullmatch(text)) or text.startswith((".", "~")):
        return False
    return not Path(text.split("/")[0]).exists()


def hub_gguf_path(text: str, online: bool) -> Path:
    """The local path of the GGUF file `text` names (`is_hub_gguf`), downloaded first where `online`; the first
    part of a split model, its other parts beside it."""
    if match := QUANT_SPEC.fullmatch(text):
        repo, file = match["repo"], quant_file(match["repo"], match["quant"], online)
    else:
        match = FILE_SPEC.fullmatch(text)
        repo, file = match["repo"], match["file"]
    first = download(repo, file, online)
    for part in split_names(file)[1:]:
        download(repo, part, online)
    return first


def split_names(file: str) -> list[str]:
    """The repository paths of a split model's parts from its first part's (`gguf_header.named_parts`'s rule)."""
    path = PurePosixPath(file)
    match = SPLIT_NAME.fullmatch(path.name)
    if match is None or int(match["no"]) != 1:
        return [file]
    count = int(match["count"])
    return [str(path.with_name(f"{match['prefix']}-{no:05d}-of-{match['count']}{match['suffix']}"))
            for no in range(1, count + 1)]


def quant_file(repo: str, quant: str, online: bool) -> str:
    """The repository's one model file with `quant` in its name (any case), a split model by its first part."""
    files = repo_files(repo, online)
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    matching = [f for f in ggufs if quant.lower() in PurePosixPath(f).name.lower() and first_part(f)]
    if len(matching) == 1:
        return matching[0]
    if not matching:
        have = ", ".join(sorted(PurePosixPath(f).name for f in ggufs if first_part(f))[:8]) or "no .gguf file"
        where = "" if online else " in the local Hugging Face cache (offline)"
        raise ModelLoadError(f"{repo}: no GGUF file with {quant!r} in its name{where}; it has: {have}")
    raise ModelLoadError(f"{repo}: {len(matching)} GGUF files have {quant!r} in their names "
                         f"({', '.join(PurePosixPath(f).name for f in sorted(matching)[:6])}); name one as "
                         f"{repo}/FILE.gguf")


def first_part(file: str) -> bool:
    match = SPLIT_NAME.fullmatch(PurePosixPath(file).name)
    return match is None or int(match["no"]) == 1


def repo_files(repo: str, online: bool) -> list[str]:
    """The repository's files: listed by the hub online; offline, those of its newest snapshot in the cache."""
    from huggingface_hub import HfApi, snapshot_download

    try:
        if online:
            return HfApi().list_repo_files(repo)
        folder = Path(snapshot_download(repo, local_files_only=True, allow_patterns=["*.gguf"]))
        return [str(p.relative_to(folder)) for p in folder.rglob("*.gguf")]
    except Exception as error:  # the hub's errors, each told apart by `hub_error`
        raise hub_error(error, repo, None, online) from None


def download(repo: str, file: str, online: bool) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, file, local_files_only=not online))
    except Exception as error:
        raise hub_error(error, repo, file, online) from None


def hub_error(error: Exception, repo: str, file: str | None, online: bool) -> ModelLoadError:
    """One line for what the hub (or the cache, offline) answered."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    from utils.printing import one_line

    what = f"{repo}/{file}" if file else repo
    if isinstance(error, LocalEntryNotFoundError) or not online and isinstance(error, (FileNotFoundError, OSError)):
        return ModelLoadError(f"cannot load model {what!r}: the Hugging Face hub cannot be reached (or "
                              "HF_HUB_OFFLINE is set) and the local Hugging Face cache does not hold it")
    if isinstance(error, GatedRepoError):
        return ModelLoadError(f"{repo} is gated: accept its terms on huggingface.co and log in (`hf auth login`)")
    if isinstance(error, RepositoryNotFoundError):
        return ModelLoadError(f"no repository {repo} on the Hugging Face hub (or it is private: log in with "
                              "`hf auth login`)")
    if isinstance(error, EntryNotFoundError):
        return ModelLoadError(f"{repo} has no file {file}")
    if isinstance(error, OSError) and error.errno is not None:
        return ModelLoadError(f"cannot download {what}: {error.strerror or one_line(error)}")
    return ModelLoadError(f"cannot download {what}: {type(error).__name__}: {one_line(error)}")
