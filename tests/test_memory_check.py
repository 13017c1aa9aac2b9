"""A dense model whose weights cannot fit in the free memory is refused in one line before they are read."""

import pytest
import torch
from transformers import LlamaConfig

from cli_models import write_tiny_model
from utils.models import memory_check
from utils.models.load_error import ModelLoadError
from utils.models.model_loader import load_model

LLAMA_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256)


def test_the_weights_bytes_come_from_the_config_alone():
    assert memory_check.weight_bytes(LLAMA_8B, torch.float32) == 8_030_261_248 * 4  # Llama 3.1 8B's parameters
    tied = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       vocab_size=1000, tie_word_embeddings=True)
    untied = LlamaConfig(**{**tied.to_dict(), "tie_word_embeddings": False})
    assert memory_check.weight_bytes(untied, torch.bfloat16) - memory_check.weight_bytes(tied, torch.bfloat16) == \
        1000 * 64 * 2  # a tied head is counted once


def test_a_quantized_checkpoint_is_not_counted_at_full_precision():
    gptq = LlamaConfig(**{**LLAMA_8B.to_dict(), "quantization_config": {"quant_method": "gptq", "bits": 4}})
    assert memory_check.weight_bytes(gptq, torch.float16) is None  # loaded, and judged, as before


@pytest.mark.parametrize("free_gb, advice", [
    (20, "--dtype bfloat16 takes 16.1 GB"),
    (10, "a Q4_K_M GGUF file of it takes about 4.9 GB, run at its own precision"),
    (3, "even a Q4_K_M GGUF file of it would take about 4.9 GB"),
])
def test_a_model_past_the_free_memory_is_refused_naming_what_would_fit(monkeypatch, free_gb, advice):
    monkeypatch.setattr(memory_check, "free_bytes", lambda: free_gb * 10**9)
    with pytest.raises(ModelLoadError) as error:
        memory_check.check_memory("owner/model", LLAMA_8B, torch.float32)
    assert str(error.value) == (f"owner/model: its weights take 32.1 GB in float32, more than this machine has free "
                                f"({free_gb:.1f} GB of memory and swap); {advice}")
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 40 * 10**9)
    memory_check.check_memory("owner/model", LLAMA_8B, torch.float32)  # fits: nothing said
    monkeypatch.setattr(memory_check, "free_bytes", lambda: None)
    memory_check.check_memory("owner/model", LLAMA_8B, torch.float32)  # cannot be told: loaded as before


def test_free_memory_is_what_the_kernel_counts_available_within_a_cgroup_limit_plus_swap(tmp_path, monkeypatch):
    info = {"MemTotal": 24 << 30, "MemAvailable": 20 << 30, "SwapFree": 2 << 30}
    monkeypatch.setattr(memory_check, "meminfo", lambda: info)
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(memory_check, "CGROUP_FILES", ((str(limit), str(usage)),))
    assert memory_check.free_bytes() == 22 << 30  # no cgroup files: the machine's
    limit.write_text("max\n")
    usage.write_text(f"{1 << 30}\n")
    assert memory_check.free_bytes() == 22 << 30  # no limit
    limit.write_text(f"{8 << 30}\n")  # a container of 8 GB, 1 GB of it used
    assert memory_check.free_bytes() == (7 << 30) + (2 << 30)
    monkeypatch.setattr(memory_check, "meminfo", lambda: {})
    assert memory_check.free_bytes() is None  # not Linux


def test_meminfo_reads_the_kernels_table_in_bytes():
    info = memory_check.meminfo()
    assert info["MemTotal"] >= info["MemAvailable"] > 0 and info["MemTotal"] % 1024 == 0


def test_a_load_past_the_free_memory_is_refused_before_its_weights_are_read(tmp_path, monkeypatch):
    """A user's 8B in float32 on a 16 GB machine loaded for minutes until the kernel killed the process ("Killed",
    no word of ours)."""
    import transformers

    write_tiny_model(tmp_path)
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 1000)
    read = transformers.AutoModelForCausalLM.from_pretrained
    with monkeypatch.context() as patch:
        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                      lambda *a, **k: pytest.fail("the weights were read before the check"))
        with pytest.raises(ModelLoadError, match=r"its weights take 0\.0 GB in float32, more than this machine has "
                                                 r"free \(0\.0 GB of memory and swap\)"):
            load_model(str(tmp_path), device="cpu", dtype="float32", progress=False)
    assert transformers.AutoModelForCausalLM.from_pretrained == read
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 10**12)
    loaded, _ = load_model(str(tmp_path), device="cpu", dtype="float32", progress=False)
    assert sum(p.numel() for p in loaded.parameters()) * 4 == memory_check.weight_bytes(loaded.config, torch.float32)


def test_a_gguf_file_past_the_free_memory_is_refused_before_its_preparation(tmp_path, monkeypatch, capsys):
    """The preparation copies every block of the file off its mapping, and holds them all until it saves them."""
    from gguf_models import write_tiny_gguf

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True)
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 1000)
    size = path.stat().st_size / 1e9
    with pytest.raises(ModelLoadError, match=rf"^{path}: preparing it holds its {size:.1f} GB of blocks in memory, "
                                             r"more than this machine has free \(0\.0 GB of memory and swap\)"):
        load_model(str(path), device="cpu", dtype="native", kernels="gguf", progress=True)
    assert "preparing" not in capsys.readouterr().err
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 10**12)
    load_model(str(path), device="cpu", dtype="native", kernels="gguf", progress=False)
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 1000)
    load_model(str(path), device="cpu", dtype="native", kernels="gguf", progress=False)  # prepared: mapped, not held
