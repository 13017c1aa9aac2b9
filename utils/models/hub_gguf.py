"""GGUF files on the Hugging Face hub, named as llama.cpp's `-hf` names them: `owner/repo:QUANT` (the repository's
one model file, or split model, with QUANT in its name: `Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:q4_k_m`) or
`owner/repo/FILE.gguf` (a file by its path in the repository). The file is downloaded into the Hugging Face
cache (its progress bar, its resumable downloads), every part of a split model with it from the same commit,
then runs as a local `.gguf` file: at its own precision on the CPU. Offline, the cache alone answers.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from utils.models.gguf_header import SPLIT_COUNT, SPLIT_NAME, GGUFHeaderError, named_parts, walk_header
from utils.models.load_error import ModelLoadError

# owner/repo:QUANT: the hub's names are letters, digits, '-', '_' and '.'
QUANT_SPEC = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+):(?P<quant>[\w.-]+)")
FILE_SPEC = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)/(?P<file>[^:]+\.gguf)", re.IGNORECASE)
DEFAULT_QUANT = "Q4_K_M"  # what a repository of GGUF files named alone runs, as llama.cpp's `-hf` picks
UNCACHED = ("the Hugging Face hub cannot be reached (or HF_HUB_OFFLINE is set) and the local Hugging Face cache "
            "does not hold it")


class GGUFRepository(ModelLoadError):
    """A model id names a repository of GGUF files (no config.json): `load_model` runs its DEFAULT_QUANT file."""


def not_in_local_cache(error: BaseException) -> bool:
    """Whether a load failed for want of files in the local Hugging Face cache (transformers wraps the hub's
    LocalEntryNotFoundError in an OSError), not for what the files hold."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    while error is not None:
        if isinstance(error, LocalEntryNotFoundError):
            return True
        error = error.__cause__ or error.__context__
    return False


def is_hub_gguf(text: str) -> bool:
    """Whether `text`, which is no local file or folder, names a GGUF file on the hub. A path to a file whose first
    folder exists here is a mistyped local path, said as one."""
    if text.startswith((".", "~")):
        return False
    if QUANT_SPEC.fullmatch(text):
        return True
    return bool(FILE_SPEC.fullmatch(text)) and not Path(text.split("/")[0]).exists()


def hub_gguf_path(text: str, online: bool) -> Path:
    """The local path of the GGUF file `text` names (`is_hub_gguf`), downloaded first where `online`; the first
    part of a split model, its other parts beside it (from the first one's commit)."""
    if match := QUANT_SPEC.fullmatch(text):
        repo, file = match["repo"], quant_file(match["repo"], match["quant"], online)
    else:
        match = FILE_SPEC.fullmatch(text)
        repo, file = match["repo"], match["file"]
    if online:
        check_room(repo, file)
    first = download(repo, file, online)
    try:
        count = walk_header(first).scalars.get(SPLIT_COUNT, 1)
    except (GGUFHeaderError, OSError):  # a damaged file: the loader's header check says what is wrong, in one line
        return first
    if count > 1:
        # the snapshot folder the first part lies in is named after its commit: the other parts come from it too
        commit = first.parents[len(PurePosixPath(file).parts) - 1].name
        for part in named_parts(PurePosixPath(file))[1:]:
            download(repo, str(part), online, commit)
    return first


def check_room(repo: str, file: str) -> None:
    """ModelLoadError before a download, where the model's parts (the hub's sizes) cannot be prepared in the free
    memory: the loader would refuse it after the download. A file already in the Hugging Face cache, or sizes the
    hub does not give, are left to that check."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    from utils.models.memory_check import check_blocks_fit

    if isinstance(try_to_load_from_cache(repo, file), str):
        return
    try:
        infos = HfApi().get_paths_info(repo, [str(part) for part in named_parts(PurePosixPath(file))])
    except Exception:  # no answer: the download says what is wrong, in its own line
        return
    check_blocks_fit(f"{repo}/{file}", sum(getattr(info, "size", 0) or 0 for info in infos))


def quant_file(repo: str, quant: str, online: bool) -> str:
    """The repository's one model file with `quant` in its name between separators, any case (`F16` is not
    `BF16`), or among several the one whose tag ends with it (`Q4_0`, not `Q4_0_4_4`); a split model by its first
    part; vision projectors (`mmproj`) are no model to run."""
    files = [f for f in repo_files(repo, online) if f.lower().endswith(".gguf")]
    models = [f for f in files if first_part(f) and not PurePosixPath(f).name.lower().startswith("mmproj")]
    tag = re.compile(rf"(?<![a-z0-9]){re.escape(quant.lower())}(?![a-z0-9])")
    matching = [f for f in models if tag.search(PurePosixPath(f).name.lower())]
    # `Q4_0` names both `-Q4_0.gguf` and the repacked `-Q4_0_4_4.gguf`: a file whose tag ends there is the one meant
    whole = re.compile(rf"(?<![a-z0-9]){re.escape(quant.lower())}(?![a-z0-9_])")
    exact = [f for f in matching if whole.search(PurePosixPath(f).name.lower())]
    chosen = matching if len(matching) == 1 else exact
    if len(chosen) == 1:
        return chosen[0]
    if not matching:
        where = "" if online else " in the local Hugging Face cache (offline)"
        raise ModelLoadError(f"{repo}: no GGUF file with {quant!r} in its name{where}; it has: {listed(models)}")
    raise ModelLoadError(f"{repo}: {len(matching)} GGUF files have {quant!r} in their names ({listed(matching)}); "
                         f"name one as {repo}/FILE.gguf")


def listed(files: list[str], most: int = 8) -> str:
    """Repository paths for a one-line message (a file in a folder is named with it, as `owner/repo/FILE.gguf`
    needs)."""
    if not files:
        return "no .gguf file"
    shown = sorted(files)[:most]
    return ", ".join(shown) + (f" and {len(files) - most} more" if len(files) > most else "")


def first_part(file: str) -> bool:
    match = SPLIT_NAME.fullmatch(PurePosixPath(file).name)
    return match is None or int(match["no"]) == 1


def repo_files(repo: str, online: bool) -> list[str]:
    """The repository's files: listed by the hub online (where it fails to answer, the cache's); offline, those of
    the cached snapshot of its main branch."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    if online:
        try:
            return HfApi().list_repo_files(repo)
        except RepositoryNotFoundError as error:  # gated repositories too
            raise hub_error(error, repo, None, online) from None
        except Exception as error:  # no answer (a blocked port, the hub's 5xx): what the cache holds, if anything
            try:
                return cached_files(repo)
            except ModelLoadError:
                raise hub_error(error, repo, None, online) from None
    return cached_files(repo)


def cached_files(repo: str) -> list[str]:
    """The files of the repository's main branch in the Hugging Face cache, as the hub's client lays it out:
    refs/main names the commit whose snapshot folder holds them. Read directly: `snapshot_download` refuses a
    snapshot it knows to be partial, the usual state after downloading one quantisation."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    try:
        root = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    except ValueError as error:  # HFValidationError
        raise invalid_id(repo, error) from None
    try:
        folder = root / "snapshots" / (root / "refs" / "main").read_text().strip()
        files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    except OSError:
        files = []
    if not files:
        raise ModelLoadError(f"cannot load model {repo!r}: {UNCACHED}")
    return files


def named_as_gguf_repository(repo: str) -> bool:
    """Whether a hub id is named the way repositories of GGUF files are (`…-GGUF`)."""
    return repo.lower().endswith("gguf")


def gguf_repository(repo: str, error: BaseException) -> bool:
    """Whether a model id failed to load as a transformers model because its repository holds GGUF files and no
    config.json: the hub said so, or (offline) the cache's snapshot shows it."""
    if "config.json" in str(error):
        return named_as_gguf_repository(repo)
    try:
        files = cached_files(repo)
    except ModelLoadError:
        return False
    return "config.json" not in files and any(f.lower().endswith(".gguf") for f in files)


def download(repo: str, file: str, online: bool, revision: str | None = None) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, file, revision=revision, local_files_only=not online))
    except Exception as error:
        raise hub_error(error, repo, file, online) from None


def invalid_id(repo: str, error: Exception) -> ModelLoadError:
    from utils.printing import one_line

    return ModelLoadError(f"{repo!r} is no Hugging Face id ({one_line(error).split('. ')[0]}); name a GGUF file on "
                          "the hub as owner/repo:QUANT or owner/repo/FILE.gguf (no revision, no trailing '/')")


def hub_error(error: Exception, repo: str, file: str | None, online: bool) -> ModelLoadError:
    """One line for what the hub (or the cache, offline) answered."""
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HFValidationError, RepositoryNotFoundError

    from utils.printing import one_line

    what = f"{repo}/{file}" if file else repo
    if isinstance(error, HFValidationError):
        return invalid_id(repo, error)
    if not_in_local_cache(error):
        if file and not online:  # the repository may be cached without this file: say what it has
            try:
                files = [f for f in cached_files(repo) if f.lower().endswith(".gguf") and first_part(f)]
            except ModelLoadError:
                files = []
            if files:
                return ModelLoadError(f"{repo} in the local Hugging Face cache (offline) has no file {file}; it has: "
                                      f"{listed(files)}")
        return ModelLoadError(f"cannot load model {what!r}: {UNCACHED}")
    if isinstance(error, GatedRepoError):
        return ModelLoadError(f"{repo} is gated: accept its terms on huggingface.co and log in (`hf auth login`)")
    if isinstance(error, RepositoryNotFoundError):
        return ModelLoadError(f"no repository {repo} on the Hugging Face hub (or it is private: log in with "
                              "`hf auth login`)")
    if isinstance(error, EntryNotFoundError):
        return ModelLoadError(f"{repo} has no file {file}")
    if isinstance(error, OSError) and error.errno is not None:
        return ModelLoadError(f"cannot {'download' if online else 'read'} {what}: {error.strerror or one_line(error)}")
    return ModelLoadError(f"cannot {'download' if online else 'read'} {what}: {type(error).__name__}: "
                          f"{one_line(error)}")
