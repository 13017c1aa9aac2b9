"""A GGUF file's model config, read the way transformers' GGUF loader reads it, without its slow metadata parse.

For most architectures (Qwen2 and Llama among them) `AutoConfig.from_pretrained(..., gguf_file=...)` goes through
`load_gguf_checkpoint`, whose `gguf.GGUFReader` builds numpy views for each of the vocabulary's 150k strings only
to read a dozen numbers: 12.8 s a file on the Zen 3 of benchmarks/RESULTS.md, two of them in every first start.
transformers' own fast reader (`read_gguf_metadata`, which it uses for the tokenizer and for a few newer
architectures' configs) walks the same metadata in a fraction of a second. This module applies transformers'
own key mapping (`GGUF_CONFIG_MAPPING`, the loader's `GGUF_TO_TRANSFORMERS_MAPPING["config"]`), defaults,
tied-embedding and vocabulary-size rules to what that reader returns, for the architectures the native path
runs, which take no special case in `load_gguf_checkpoint`. Everything else (and a Llama file named "mistral",
which that loader renames) goes to AutoConfig. tests/test_gguf_config.py checks both give the same config for
every architecture here.
"""

from __future__ import annotations

from pathlib import Path

# the native path's architectures (gguf_native.PLAIN_ARCHS | PERMUTED_QK_ARCHS): no special case in the loader
FAST_ARCHS = {"qwen2", "qwen3", "mistral", "phi3", "starcoder2", "olmo", "olmo2", "granite", "llama"}


def architecture_unread(arch: str | None) -> str | None:
    """One line where transformers reads no GGUF file of architecture `arch`, else None. Its loader says so only
    after a model's preparation began (on a first start, after the kernel build: a minute). It also reads names
    that hold a listed one or a spelling of it (qwen2moe as qwen2_moe, t5encoder as t5): those pass, for it to
    judge."""
    from transformers import __version__
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    def bare(name: str) -> str:
        return name.replace("_", "").replace("-", "").lower()

    if not arch or any(bare(listed) in bare(arch) for listed in GGUF_SUPPORTED_ARCHITECTURES if listed != "general"):
        return None
    readable = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    return f"transformers {__version__} reads no GGUF model of the {arch} architecture (it reads {', '.join(readable)})"


def config_dict(metadata: dict, tensor_names: tuple[str, ...]) -> dict | None:
    """`load_gguf_checkpoint(...)["config"]` for a file of a FAST_ARCHS architecture transformers reads GGUF files
    of; None for any other (AutoConfig then says what it says)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = metadata.get("general.architecture")
    if arch not in FAST_ARCHS or arch not in GGUF_CONFIG_MAPPING or metadata.get("general.name") == "mistral":
        return None
    config = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, config_key = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(config_key)
        if renamed is None or renamed == -1:
            continue
        if isinstance(value, list):  # the loader turns a one-item array into its item
            value = value[0] if len(value) == 1 else value
        config[renamed] = value
    if "vocab_size" not in config:
        tokens = metadata.get("tokenizer.ggml.tokens")  # the fast reader leaves a string array as its length
        if isinstance(tokens, int):
            config["vocab_size"] = tokens
        elif tokens is not None:
            config["vocab_size"] = len(tokens)
    return config


def gguf_config(gguf: Path):
    """The transformers config of the model in `gguf`."""
    from transformers import AutoConfig
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from utils.models.gguf_header import split_parts, walk_header

    metadata, names = read_gguf_metadata(str(gguf))
    for part in split_parts(gguf)[1:]:  # a split file's tensors (`output.weight` among them) lie in every part
        names += tuple(name for name, *_ in walk_header(part).tensors)
    config = config_dict(metadata, names)
    if config is None:
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    config = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    config.name_or_path = str(gguf.parent)  # as AutoConfig names it
    return config
