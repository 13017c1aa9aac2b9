"""Models with a recurrent state (Mamba; LFM2's convolutions and other hybrids): the cache is refused in one line
before anything runs, since a recurrent state cannot be cut back to the tokens before a rejected draft; with the
cache off they decode exactly, and the float32 speed options leave alone the projections such models read
themselves."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import Lfm2Config, Lfm2ForCausalLM, MambaConfig, MambaForCausalLM

from cli_models import WORDS, write_tiny_model
from conftest import PROMPT, VOCAB, tiny_decoder
from sampling import autoregressive_generate, autoregressive_run, speculative_generate
from test_cli import ROOT, env
from utils.caching import cache_refusal, new_cache
from utils.model_runner import ModelRunner
from utils.models.cpu_kernels import called_linears, quantize_int8, use_onednn_linear


def tiny_mamba(seed: int = 0, vocab: int = VOCAB) -> MambaForCausalLM:
    torch.manual_seed(seed)
    config = MambaConfig(vocab_size=vocab, hidden_size=32, state_size=8, num_hidden_layers=2, bos_token_id=0,
                         eos_token_id=1, pad_token_id=0, initializer_range=0.3)
    return MambaForCausalLM(config).eval()


def tiny_lfm2_with_convolutions(seed: int = 0) -> Lfm2ForCausalLM:
    torch.manual_seed(seed)
    config = Lfm2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                        bos_token_id=0, eos_token_id=1, pad_token_id=0, initializer_range=0.3)
    return Lfm2ForCausalLM(config).eval()


@torch.no_grad()
def argmax_loop(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full passes, no cache: the reference."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_attention_models_take_the_cache_and_recurrent_ones_are_refused_by_name():
    assert cache_refusal(tiny_decoder("llama")) is None
    assert cache_refusal(tiny_decoder("mistral")) is None  # sliding windows roll back (recorded past)
    mamba = cache_refusal(tiny_mamba())
    assert mamba.startswith("MambaForCausalLM keeps its own recurrent state")
    lfm2 = cache_refusal(tiny_lfm2_with_convolutions())
    assert "LinearAttentionLayer" in lfm2 and "recurrent state" in lfm2
    with pytest.raises(ValueError, match="recurrent state .* run it with the cache off"):
        new_cache(tiny_mamba())


@pytest.mark.parametrize("make", [tiny_mamba, tiny_lfm2_with_convolutions], ids=["mamba", "lfm2"])
def test_the_cache_is_refused_before_anything_runs(make):
    """Mamba with the cache on answered garbage (it takes `cache_params`, so the cache passed was ignored and each
    pass saw only its new token); LFM2 failed at its first rejected draft, mid-answer."""
    target, drafter = make(0), make(1)
    with pytest.raises(ValueError, match="recurrent state"):
        ModelRunner(target, use_cache=True)
    with pytest.raises(ValueError, match="recurrent state"):
        autoregressive_generate(PROMPT, target, 6, eos_tokens_id=None, use_cache=True)
    with pytest.raises(ValueError, match="recurrent state"):
        speculative_generate(PROMPT, drafter, target, gamma=3, max_gen_len=6, eos_tokens_id=None, use_cache=True)


@pytest.mark.parametrize("make", [tiny_mamba, tiny_lfm2_with_convolutions], ids=["mamba", "lfm2"])
def test_cache_off_they_decode_exactly_and_a_long_prompt_is_read_in_one_pass(make):
    """A prompt longer than the prefill chunk was read cache off through a cache of its own, in chunks: a model
    that ignores the cache saw only the last chunk."""
    target, drafter = make(0), make(1)
    prompt = PROMPT * 3  # 36 tokens, past a chunk of 8
    reference = argmax_loop(target, prompt, 6)
    runner = ModelRunner(target, prefill_chunk=8)
    assert runner.prefill_chunk == 0
    assert autoregressive_run(prompt, target, 6, eos_tokens_id=None, runner=runner).tokens == reference
    tokens, _ = speculative_generate(prompt, drafter, target, gamma=3, max_gen_len=6, eos_tokens_id=None)
    assert tokens == reference


def test_the_float32_speed_options_leave_the_projections_mamba_reads_itself():
    """Mamba multiplies by `dt_proj.weight` in its scan and reads `lm_head.weight.dtype`: swapped for a packed
    oneDNN or int8 layer, the model crashed at its first pass."""
    model = tiny_mamba()
    reference = argmax_loop(model, PROMPT, 5)
    kept = {name for name, module in model.named_modules() if type(module) is torch.nn.Linear}
    called = called_linears(model)
    assert type(model.lm_head) is torch.nn.Linear and id(model.lm_head) not in called
    assert all(id(layer.mixer.dt_proj) not in called and id(layer.mixer.in_proj) in called
               for layer in model.backbone.layers)
    assert use_onednn_linear(model) == len(called) > 0
    assert type(model.backbone.layers[0].mixer.dt_proj) is torch.nn.Linear
    assert type(model.backbone.layers[0].mixer.in_proj) is not torch.nn.Linear
    assert argmax_loop(model, PROMPT, 5) == reference  # the same numbers, another layout
    int8 = tiny_mamba()
    assert 0 < quantize_int8(int8) < len(kept)
    argmax_loop(int8, PROMPT, 5)  # runs (int8 changes the logits: a drafter's option)


def test_the_trace_leaves_nothing_behind_even_when_the_pass_fails():
    model = tiny_mamba()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    called_linears(model)
    assert all(type(m) is torch.nn.Linear and "trace" not in vars(m) for m in linears)

    def fail(*args, **kwargs):
        raise RuntimeError("this architecture's own code failed")

    model.backbone.layers[0].mixer.forward = fail
    assert called_linears(model) == set()  # nothing replaced; the model's own error comes when it runs
    assert all(type(m) is torch.nn.Linear and "trace" not in vars(m) for m in linears)


def test_wrappers_whose_forward_takes_kwargs_keep_the_cache():
    """A torch.compile'd model's forward is (*args, **kwargs): it was refused as recurrent."""
    model = tiny_decoder("llama")
    compiled = torch.compile(model, backend="eager")
    assert cache_refusal(compiled) is None
    reference = autoregressive_generate(PROMPT, model, 5, eos_tokens_id=None)
    assert autoregressive_generate(PROMPT, compiled, 5, eos_tokens_id=None, use_cache=True) == reference


def test_an_attention_model_still_has_every_linear_swapped():
    model = tiny_decoder("llama").float().cpu()  # oneDNN is a CPU feature, whatever SPECDEC_TEST_DEVICE says
    linears = sum(type(module) is torch.nn.Linear for module in model.modules())
    assert use_onednn_linear(model) == linears
    assert not any(type(module) is torch.nn.Linear for module in model.modules())


@pytest.fixture(scope="module")
def mamba_folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("mamba")
    for name, seed in (("target", 0), ("drafter", 1)):
        write_tiny_model(base / name, seed=seed)  # the tokenizer and chat template
        tiny_mamba(seed, vocab=len(WORDS)).save_pretrained(base / name)  # the weights and config replaced
    return base / "target", base / "drafter"


def run_infer(folders, *args, stdin: str | None = None):
    target, drafter = folders
    argv = [sys.executable, "infer.py", "--target", str(target), "--drafter", str(drafter), "--length", "4", *args]
    return subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, timeout=300, text=True, input=stdin)


def test_the_chat_runs_a_mamba_folder_and_refuses_its_cache_in_one_line(mamba_folders):
    done = run_infer(mamba_folders, "--json", "--prompt", "hello world write code")
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["generator"] for r in reports] == ["target", "speculative", "ngram", "drafter"]
    assert reports[0]["token_ids"] == reports[1]["token_ids"] == reports[2]["token_ids"]
    assert all(r["error"] is None for r in reports)
    refused = run_infer(mamba_folders, "--cache", "--prompt", "hi")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("--cache: MambaForCausalLM keeps its own recurrent") and last.endswith("without --cache")
    repl = run_infer(mamba_folders, stdin="/cache\n/quit\n")
    assert repl.returncode == 0, repl.stderr[-2000:]
    assert "the cache stays off: MambaForCausalLM keeps its own recurrent state" in repl.stdout
    assert "cache off" not in repl.stdout
    assert "cache: on" not in repl.stdout
