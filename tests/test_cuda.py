"""The CUDA path: the CLI and a GGUF file on a GPU.

Skipped where torch sees no CUDA device (CI and the project's CPU machines), so these pin nothing there. On a
machine with a GPU, run them with the tests that take their tiny models from conftest on it:

    SPECDEC_TEST_DEVICE=cuda python -m pytest tests/test_cuda.py tests/test_lossless_greedy.py ...

(benchmarks/RESULTS.md, "CUDA path", names the files and what they gave on an H200.)
"""

import json
import subprocess
import sys

import pytest
import torch

from gguf_models import write_tiny_gguf
from sampling import autoregressive_generate, speculative_generate
from test_cli import ROOT, env, folders  # noqa: F401 (folders: the fixture)
from utils.models.model_loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

PROMPT_IDS = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6]


def run_cli(tmp_path, *args) -> subprocess.CompletedProcess:
    cache = env(SPECDEC_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "infer.py", *args], cwd=ROOT, env=cache, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
@pytest.mark.parametrize("cache", [[], ["--cache"]])
def test_cli_answers_with_every_generator_on_cuda(folders, tmp_path, dtype, cache):
    """auto is bfloat16 on CUDA: the generators must run and report; in float32 greedy ones must agree."""
    target, drafter = folders
    done = run_cli(tmp_path, "--target", str(target), "--drafter", str(drafter), "--device", "cuda", "--dtype", dtype,
                   "--json", "--prompt", "write a function", "--length", "16", *cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["generator"] for r in reports] == ["target", "speculative", "ngram", "drafter"]
    for r in reports:
        assert r["error"] is None and r["tokens_generated"] == len(r["token_ids"]) > 0 and r["tokens_per_s"] > 0
    if dtype == "float32":
        assert reports[1]["token_ids"] == reports[0]["token_ids"] == reports[2]["token_ids"]


def test_gguf_file_runs_dequantized_on_cuda(tmp_path, monkeypatch):
    """Native precision is CPU only: on CUDA a GGUF file is dequantized, and asking for native says so."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", seed=0, tokenizer=True)
    drafter_path = write_tiny_gguf(tmp_path / "drafter.gguf", "qwen2", seed=1, tokenizer=True)
    target, _ = load_model(str(path), device="cuda", dtype="float32", progress=False)
    drafter, _ = load_model(str(drafter_path), device="cuda", dtype="float32", progress=False)
    assert target.device.type == "cuda" and next(target.parameters()).dtype == torch.float32
    reference = autoregressive_generate(PROMPT_IDS, target, max_gen_len=24, eos_tokens_id=-1)
    for use_cache in (False, True):
        out, _ = speculative_generate(PROMPT_IDS, drafter, target, gamma=3, max_gen_len=24, eos_tokens_id=-1,
                                      use_cache=use_cache)
        assert out == reference
    bf16, _ = load_model(str(path), device="cuda", progress=False)
    assert next(bf16.parameters()).dtype in (torch.bfloat16, torch.float16)
    done = run_cli(tmp_path, "--target", str(path), "--drafter", str(path), "--device", "cuda", "--dtype", "native",
                   "--json", "--prompt", "hi", "--length", "2")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "runs GGUF models" in done.stderr and "on the CPU" in done.stderr
