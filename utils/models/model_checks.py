"""What is checked of a model's files before transformers or our preparation reads them, so that each problem is
one line in our words, said before slow work (a first start's kernel build) rather than after it."""

from __future__ import annotations

from pathlib import Path

from utils.models.load_error import ModelLoadError
from utils.printing import one_line


def check_gguf_header(path: Path) -> list[Path]:
    """Checks the file's header (and its other parts' for a split file); returns the parts."""
    from utils.models.gguf_config import architecture_unread
    from utils.models.gguf_header import GGUFHeaderError, split_parts, walk_header

    try:
        header = walk_header(path)
        parts = split_parts(path)
    except GGUFHeaderError as error:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({error})") from None
    except OSError as error:
        raise ModelLoadError(f"cannot read {path}: {error.strerror or one_line(error)}") from None
    if unread := architecture_unread(header.texts.get("general.architecture")):  # first: converting again won't do
        raise ModelLoadError(f"{path}: {unread}")
    if "tokenizer.ggml.tokens" not in header.keys:
        raise ModelLoadError(f"{path} carries no tokenizer (no tokenizer.ggml.tokens in its metadata): "
                             "convert the model again with its tokenizer")
    return parts


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken")


def check_model_folder(folder: Path) -> None:
    """What transformers says in other words, one line each: a folder without config.json ("Should have a
    `model_type` key in its config.json"), one holding only weights (advice to install sentencepiece), an unreadable
    one (`is_file` raises PermissionError: a traceback in the chat)."""
    try:
        has_config = (folder / "config.json").is_file()
        has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken"))
    except OSError as error:
        raise ModelLoadError(f"cannot read {folder}: {error.strerror or one_line(error)}") from None
    if not has_config:
        raise ModelLoadError(f"{folder} has no config.json: not a transformers model folder (a GGUF model is named by "
                             "its .gguf file)")
    if not has_tokenizer:
        raise ModelLoadError(f"{folder} has no tokenizer: none of {', '.join(TOKENIZER_FILES[:3])} (or the other "
                             "tokenizer files) is in it; copy them from the model's original folder")
    check_files_readable(folder)


# Besides TOKENIZER_FILES, what transformers reads from a model folder by name.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "chat_template.jinja", "chat_template.json", "merges.txt",
               "model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_files_readable(folder: Path) -> None:
    """A file transformers reads that this user may not: safetensors reports it as "No such file or directory",
    transformers' JSON reads as a bare errno line. Opening each (no bytes read) names it in our words. Only its
    files: an unreadable LICENSE.txt or training_args.bin stays none of our business."""
    weights = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    for path in [*(folder / name for name in MODEL_FILES + TOKENIZER_FILES), *weights]:
        if not path.is_file():  # absent, a dangling link (transformers says what it lacks), a FIFO (would block)
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as error:
            raise ModelLoadError(f"cannot read {path}: {error.strerror or one_line(error)}") from None
