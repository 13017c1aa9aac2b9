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


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_metadata_other_than_the_defaults_reach_the_config(tmp_path, monkeypatch, arch):
    """The tiny files' rope base (10000) and norm epsilon are transformers' defaults, so a key read wrongly or not
    at all still gave the same config: Qwen2.5's files carry a rope base of 1e6."""
    from gguf import GGUFWriter

    monkeypatch.setattr(GGUFWriter, "add_rope_freq_base", lambda self, value: self.add_float32(
        f"{self.arch}.rope.freq_base", 1000000.0))
    monkeypatch.setattr(GGUFWriter, "add_layer_norm_rms_eps", lambda self, value: self.add_float32(
        f"{self.arch}.attention.layer_norm_rms_epsilon", 1e-5))
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, tokenizer=True)
    ours, theirs = gguf_config(path), auto_config(path)
    assert ours.to_dict() == theirs.to_dict()
    assert ours.rope_parameters["rope_theta"] == 1000000.0 and ours.rms_norm_eps == pytest.approx(1e-5)


def test_one_item_arrays_are_their_item_and_a_stated_vocabulary_beats_the_tokens():
    """As transformers' loader: a one-item array is read as its item; the tokens count only where the file states
    no vocabulary size."""
    metadata = {"general.architecture": "qwen2", "qwen2.attention.head_count_kv": [2], "qwen2.vocab_size": 152064,
                "tokenizer.ggml.tokens": 151665}
    config = config_dict(metadata, ("token_embd.weight",))
    assert config["num_key_value_heads"] == 2 and config["vocab_size"] == 152064
    assert config["tie_word_embeddings"] is True


def test_a_head_in_a_later_part_of_a_split_file_unties_it(tmp_path):
    """gguf-split's parts follow the tensors' order: in 27 parts of one tensor, output.weight is in the second."""
    from utils.models.gguf_header import split_parts, walk_header

    first = write_tiny_gguf(tmp_path / "m.gguf", split_tensors=1)
    parts = split_parts(first)
    assert "output.weight" not in [name for name, *_ in walk_header(parts[0]).tensors]
    assert "output.weight" in [name for name, *_ in walk_header(parts[1]).tensors]
    assert gguf_config(first).tie_word_embeddings is False
