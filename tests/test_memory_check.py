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


@pytest.mark.parametrize("free_gb, cpu, gguf, advice", [
    (20, True, False, "; --dtype bfloat16 takes 16.1 GB"),
    (10, True, False, "; a Q4_K_M GGUF file of it takes about 4.9 GB, run at its own precision"),
    (3, True, False, "; even a Q4_K_M GGUF file of it would take about 4.9 GB"),
    (10, True, True, "; --dtype auto runs its GGUF blocks at their own precision"),  # a .gguf or an embedded model
    (20, False, True, "; --dtype bfloat16 takes 16.1 GB"),  # on a GPU, a GGUF file is dequantized
    (10, False, False, ""),  # nor does a Q4_K_M file run at its own precision there
])
def test_a_model_past_the_free_memory_is_refused_naming_what_would_fit(monkeypatch, free_gb, cpu, gguf, advice):
    monkeypatch.setattr(memory_check, "free_bytes", lambda: free_gb * 10**9)
    with pytest.raises(ModelLoadError) as error:
        memory_check.check_memory("owner/model", LLAMA_8B, torch.float32, cpu=cpu, gguf=gguf)
    assert str(error.value) == (f"owner/model: its weights take 32.1 GB in float32, more than this machine has free "
                                f"({free_gb:.1f} GB of memory and swap){advice}")
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 40 * 10**9)
    memory_check.check_memory("owner/model", LLAMA_8B, torch.float32, cpu=cpu, gguf=gguf)  # fits: nothing said
    monkeypatch.setattr(memory_check, "free_bytes", lambda: None)
    memory_check.check_memory("owner/model", LLAMA_8B, torch.float32, cpu=cpu, gguf=gguf)  # cannot be told


def cgroup(folder, limit: str, usage: int, cache: int, v1: bool = False):
    folder.mkdir(parents=True, exist_ok=True)
    names = memory_check.CGROUP_V1 if v1 else memory_check.CGROUP_V2
    (folder / names[0]).write_text(f"{limit}\n")
    (folder / names[1]).write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(f"anon {usage - cache}\n{names[2]} {cache}\nother 7\n")


@pytest.mark.parametrize("v1", [False, True])
def test_free_memory_is_what_the_kernel_counts_available_within_a_cgroup_limit_plus_swap(tmp_path, monkeypatch, v1):
    """A container's limit is not in /proc/meminfo; its usage counts the page cache, which the kernel reclaims (a
    review: a model's safetensors read once, or a GGUF file just downloaded, refused the next start's load)."""
    info = {"MemTotal": 24 << 30, "MemAvailable": 20 << 30, "SwapFree": 2 << 30}
    monkeypatch.setattr(memory_check, "meminfo", lambda: info)
    root = tmp_path / "cgroup"
    base = root / "memory" if v1 else root
    own = base / "docker" / "abc"
    proc = tmp_path / "self-cgroup"
    proc.write_text("4:memory:/docker/abc\n1:cpu:/docker/abc\n" if v1 else "0::/docker/abc\n")
    monkeypatch.setattr(memory_check, "CGROUP_ROOT", root)
    real_path = memory_check.Path
    monkeypatch.setattr(memory_check, "Path", lambda p: proc if p == "/proc/self/cgroup" else real_path(p))
    assert memory_check.cgroup_folders() == [own, base / "docker", base]
    assert memory_check.free_bytes() == 22 << 30  # no cgroup files: the machine's
    cgroup(own, "max" if not v1 else str(2**63 - 4096), 1 << 30, 0, v1)
    assert memory_check.free_bytes() == 22 << 30  # no limit
    cgroup(own, str(8 << 30), 5 << 30, 3 << 30, v1)  # a container of 8 GB: 2 GB its own, 3 GB page cache
    assert memory_check.free_bytes() == (6 << 30) + (2 << 30)
    cgroup(base / "docker", str(4 << 30), 5 << 30, 3 << 30, v1)  # a parent's lower limit holds too
    assert memory_check.free_bytes() == (2 << 30) + (2 << 30)
    monkeypatch.setattr(memory_check, "meminfo", lambda: {})
    assert memory_check.free_bytes() is None  # not Linux


@pytest.mark.skipif(not memory_check.Path("/proc/meminfo").exists(), reason="Linux's /proc/meminfo")
def test_meminfo_reads_the_kernels_table_in_bytes():
    info = memory_check.meminfo()
    assert info["MemTotal"] >= info["MemAvailable"] > 0 and info["MemTotal"] % 1024 == 0


def test_a_load_past_the_free_memory_is_refused_before_its_weights_are_read(tmp_path, monkeypatch):
    """A user's 8B in float32 on a 16 GB machine loaded for minutes until the kernel killed the process ("Killed",
    no word of ours)."""
    import transformers

    write_tiny_model(tmp_path)
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 1000)
    with monkeypatch.context() as patch:
        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                      lambda *a, **k: pytest.fail("the weights were read before the check"))
        with pytest.raises(ModelLoadError, match=r"its weights take 0\.0 GB in float32, more than this machine has "
                                                 r"free \(0\.0 GB of memory and swap\)"):
            load_model(str(tmp_path), device="cpu", dtype="float32", progress=False)
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


def test_a_gguf_file_past_the_free_memory_is_refused_before_the_kernel_build(tmp_path, monkeypatch):
    """A review: on a first start the refusal came after the kernels built (a minute)."""
    from gguf_models import write_tiny_gguf
    from utils.models import model_loader

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True)
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 1000)
    monkeypatch.setattr(model_loader.qkernels, "will_build", lambda root: True)
    monkeypatch.setattr(model_loader.qkernels, "ensure", lambda *a, **k: pytest.fail("built before the check"))
    with pytest.raises(ModelLoadError, match=r"preparing it holds its 0\.0 GB of blocks in memory"):
        load_model(str(path), device="cpu", dtype="native", progress=False)


def test_an_embedded_model_past_the_free_memory_is_refused_before_its_conversion(tmp_path, monkeypatch):
    """A review: `--dtype float32` converted the embedded model (36 s for the 0.5B, holding every weight) before
    the load refused it."""
    from utils.models import model_loader

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 10**9)
    monkeypatch.setattr(model_loader, "convert_gguf", lambda *a, **k: pytest.fail("converted before the check"))
    with pytest.raises(ModelLoadError, match=r"^qwen2\.5-coder-0\.5b-instruct: its weights take 2\.5 GB in float32, "
                                             r"more than this machine has free \(1\.0 GB of memory and swap\); "
                                             r"--dtype auto runs its GGUF blocks at their own precision$"):
        load_model("qwen2.5-coder-0.5b-instruct", device="cpu", dtype="float32", progress=False)


def test_a_load_in_bfloat16_is_judged_by_its_bfloat16_bytes(monkeypatch):
    """The 8B in bfloat16 takes 16.1 GB: with 20 GB free it loads; the check must not count it in float32."""
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 20 * 10**9)
    memory_check.check_memory("owner/model", LLAMA_8B, torch.bfloat16, cpu=False, gguf=False)
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 10 * 10**9)
    with pytest.raises(ModelLoadError, match=r"^owner/model: its weights take 16\.1 GB in bfloat16, more than"):
        memory_check.check_memory("owner/model", LLAMA_8B, torch.bfloat16, cpu=False, gguf=False)


def test_a_split_gguf_model_is_judged_by_all_its_parts(tmp_path, monkeypatch):
    """Its preparation holds the blocks of every part: room for the first part alone is not room for the model."""
    from gguf_models import write_tiny_gguf
    from utils.models.gguf_header import split_parts

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    first = write_tiny_gguf(tmp_path / "m.gguf", tokenizer=True, split_tensors=10)
    total = sum(part.stat().st_size for part in split_parts(first))
    assert first.stat().st_size < total - 1
    monkeypatch.setattr(memory_check, "free_bytes", lambda: total - 1)
    with pytest.raises(ModelLoadError, match=rf"^{first}: preparing it holds its"):
        load_model(str(first), device="cpu", dtype="native", kernels="gguf", progress=False)


def test_meminfo_skips_lines_without_a_number_and_is_empty_without_the_file(tmp_path, monkeypatch):
    """Counts without a unit are counts, not kB; a line that is no number must not stop the reading (the load would
    fail on a ValueError); no /proc/meminfo (not Linux) means "cannot be told", not a crash."""
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       2048 kB\nHugePages_Total:       3\nOdd:  n/a\nEmpty:\n")
    real_path = memory_check.Path
    monkeypatch.setattr(memory_check, "Path", lambda p: fake if p == "/proc/meminfo" else real_path(p))
    assert memory_check.meminfo() == {"MemTotal": 2048 * 1024, "HugePages_Total": 3}
    fake.unlink()
    assert memory_check.meminfo() == {}
    assert memory_check.free_bytes() is None


def test_a_cgroup_over_its_limit_or_unreadable_is_judged_soundly(tmp_path, monkeypatch):
    """A cgroup past its limit leaves no room (not a negative one that swap would offset less); a memory.stat not
    in "name value" lines is skipped, not a crash; a limit above what the machine has leaves the machine's figure."""
    info = {"MemAvailable": 4 << 30, "SwapFree": 1 << 30}
    monkeypatch.setattr(memory_check, "meminfo", lambda: info)
    own = tmp_path / "cg"
    monkeypatch.setattr(memory_check, "cgroup_folders", lambda: [own])
    cgroup(own, str(16 << 30), 1 << 30, 0)  # room 15 GB, but the host has 4 GB available
    assert memory_check.free_bytes() == (4 << 30) + (1 << 30)
    cgroup(own, str(2 << 30), 3 << 30, 0)  # usage past the limit (the kernel reclaiming): no room at all
    assert memory_check.free_bytes() == 0 + (1 << 30)
    (own / "memory.stat").write_text("anon 1 2\n")  # unreadable: as if no limit were set
    assert memory_check.free_bytes() == (4 << 30) + (1 << 30)


def test_a_config_transformers_cannot_build_is_not_judged():
    """Remote code or an unknown architecture: the load says what is wrong, not this check's exception."""
    from transformers import PretrainedConfig

    assert memory_check.weight_bytes(PretrainedConfig(), torch.float32) is None


def test_weights_or_blocks_exactly_the_free_memory_fit(monkeypatch):
    """The free memory is what a load may still take: needing exactly that much is not too much."""
    need = memory_check.weight_bytes(LLAMA_8B, torch.float32)
    monkeypatch.setattr(memory_check, "free_bytes", lambda: need)
    memory_check.check_memory("owner/model", LLAMA_8B, torch.float32, cpu=True, gguf=False)
    memory_check.check_blocks_fit("m.gguf", need)
    with pytest.raises(ModelLoadError, match=r"^m\.gguf: preparing it holds its 32\.1 GB of blocks in memory"):
        memory_check.check_blocks_fit("m.gguf", need + 1)


def test_the_q4_advice_counts_the_parameters_not_the_bytes(monkeypatch):
    """In bfloat16 a parameter is 2 bytes: the Q4_K_M estimate of the 8B is its 4.9 GB whatever the dtype asked."""
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 3 * 10**9)
    with pytest.raises(ModelLoadError, match=r"in bfloat16, .*; even a Q4_K_M GGUF file of it would take about 4\.9 GB$"):
        memory_check.check_memory("owner/model", LLAMA_8B, torch.bfloat16, cpu=True, gguf=False)
