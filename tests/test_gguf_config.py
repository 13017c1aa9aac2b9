"""gguf_config reads the config transformers' GGUF loader reads, without its slow reader."""

from __future__ import annotations

import pytest
from transformers import AutoConfig
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

from gguf_models import write_tiny_gguf
from utils.models.gguf_config import FAST_ARCHS, config_dict, gguf_config

READ_HERE = sorted(arch for arch in FAST_ARCHS if arch in GGUF_CONFIG_MAPPING)


def auto_config(path):
    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def test_the_native_architectures_are_read_here():
    assert {"qwen2", "llama"} <= set(READ_HERE)


@pytest.mark.parametrize("arch", READ_HERE)
@pytest.mark.parametrize("tied", [False, True])
def test_same_config_as_transformers(tmp_path, arch, tied):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, tied=tied, tokenizer=True)
    ours, theirs = gguf_config(path), auto_config(path)
    assert type(ours) is type(theirs)
    assert ours.to_dict() == theirs.to_dict()
    assert ours.tie_word_embeddings is tied


def test_vocabulary_size_from_the_tokens_when_the_file_has_none():
    metadata = {"general.architecture": "qwen2", "qwen2.block_count": 2, "tokenizer.ggml.tokens": 151936}
    config = config_dict(metadata, ("token_embd.weight", "output.weight"))
    assert config["vocab_size"] == 151936 and config["num_hidden_layers"] == 2
    assert config["tie_word_embeddings"] is False


def test_other_files_go_to_transformers(tmp_path):
    assert config_dict({"general.architecture": "gpt2"}, ()) is None
    # the loader renames a Llama file called "mistral": left to it
    assert config_dict({"general.architecture": "llama", "general.name": "mistral"}, ()) is None
    path = write_tiny_gguf(tmp_path / "olmo.gguf", arch="olmo")  # no GGUF config mapping in transformers
    with pytest.raises(ValueError) as ours:
        gguf_config(path)
    with pytest.raises(ValueError) as theirs:
        auto_config(path)
    assert str(ours.value) == str(theirs.value)
