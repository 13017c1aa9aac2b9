"""The native mode on tiny GGUF files: the same model as transformers' GGUF loader, kernels close to the float32
reference, batch-invariant logits, and the lossless guarantees (greedy SD and NASD equal AR, sampled SD follows
the target's distribution) within the mode."""

import os

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from conftest import PROMPT
from gguf_models import ALL_Q4K, VOCAB, write_tiny_gguf
from ngram_assisted import NGramStorage, ngram_assisted_speculative_generate
from sampling import autoregressive_generate, speculative_generate
from test_distribution import PROCESSORS, chi_square_pvalue, exact_distribution, sample_speculative
from utils.caching import new_cache
from utils.models.gguf_native import build, kernel_counts, prepare
from utils.models.kernel_choice import KernelChoice
from utils.models import qkernels
from utils.models.model_loader import cache_root
from utils.models.cpu_kernels import PackedLinear
from utils.models.native_linear import Bf16Linear, GGUFEmbedding, GGUFLinear, Int4Linear


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    assert qkernels.ensure(cache_root()), qkernels.why()  # the integer kernels take part in every choice below
    folder = tmp_path_factory.mktemp("gguf")
    return {
        "qwen2": write_tiny_gguf(folder / "qwen2.gguf", "qwen2", seed=0),
        "llama": write_tiny_gguf(folder / "llama.gguf", "llama", seed=0),
        "tied": write_tiny_gguf(folder / "tied.gguf", "qwen2", seed=2, tied=True),
        "q4k": write_tiny_gguf(folder / "q4k.gguf", "qwen2", seed=3, types=ALL_Q4K),
        "drafter": write_tiny_gguf(folder / "drafter.gguf", "qwen2", seed=1),
    }


def native(path, kernels=None, drafter_int4=False, cache_dir=None):
    return build(*prepare(path, KernelChoice(cache_dir, kernels), drafter_int4))


def transformers_reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@torch.no_grad()
def logits(model, ids=PROMPT):
    return model(torch.tensor([ids])).logits[0]  # [len, vocab]


@pytest.mark.parametrize("name", ["qwen2", "llama", "tied"])
def test_f32_kernels_compute_what_transformers_gguf_loader_computes(files, name):
    """Same tensors in the same places (names, llama's q/k row order, tied head) as transformers' own loader,
    which dequantizes through the gguf package."""
    ours, reference = native(files[name], "f32"), transformers_reference(files[name])
    assert isinstance(ours.get_input_embeddings(), GGUFEmbedding)
    torch.testing.assert_close(logits(ours), logits(reference), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels, tolerance", [("gguf", 0.1), ("int4", 0.1), ("bf16", 0.1), (None, 0.1)])
def test_low_precision_kernels_stay_close_to_float32(files, kernels, tolerance):
    reference = logits(native(files["qwen2"], "f32"))
    model = native(files["qwen2"], kernels)
    got = logits(model)
    assert (got - reference).abs().max() < tolerance * reference.abs().max()
    assert (got.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    if kernels == "gguf":  # every type of the file runs as it is, F16 (ffn_up) goes to bfloat16
        assert isinstance(model.model.layers[0].self_attn.k_proj, GGUFLinear)
        assert isinstance(model.model.layers[0].mlp.down_proj, GGUFLinear)
        assert isinstance(model.model.layers[0].mlp.up_proj, Bf16Linear)
    if kernels == "int4":  # int4 runs the Q4 types as they are, the others on our kernels (F16: bfloat16)
        assert isinstance(model.model.layers[0].self_attn.q_proj, Int4Linear)
        assert isinstance(model.model.layers[0].self_attn.k_proj, GGUFLinear)
        assert isinstance(model.model.layers[0].mlp.up_proj, Bf16Linear)


def test_layers_a_forced_kernel_cannot_run_are_noted_once_per_type(files, capsys):
    """`--kernels int4` on a Q8_0 or Q6_K layer ran it in bfloat16 without a word (a user's sweep); now our kernels
    run the file's values, and one line per type says so."""
    native(files["qwen2"], "int4")
    notes = [line for line in capsys.readouterr().err.splitlines() if "--kernels int4" in line]
    assert notes == [
        "note: --kernels int4 cannot run 2 layers of type F16; they run on bf16",
        "note: --kernels int4 cannot run 2 layers of type Q5_0; they run on gguf",
        "note: --kernels int4 cannot run 3 layers of type Q6_K; they run on gguf",
        "note: --kernels int4 cannot run 2 layers of type Q8_0; they run on gguf",
    ], notes


def test_kernels_gguf8_falls_back_on_gguf_without_a_note(files, capsys):
    """`--kernels gguf8` runs a type without interleaved tiles on gguf, as its help says ("else gguf"): no note for
    those (Q5_0 here), one for a layer it runs on neither (F16)."""
    model = native(files["qwen2"], "gguf8")
    notes = [line for line in capsys.readouterr().err.splitlines() if "--kernels gguf8" in line]
    assert notes == ["note: --kernels gguf8 cannot run 2 layers of type F16; they run on bf16"], notes
    assert kernel_counts(model)["Q5_0"] == 2


def test_layers_rounded_to_bfloat16_by_the_measured_choice_are_noted(files, tmp_path, capsys, monkeypatch):
    """F16 weights measured faster in bfloat16 lose bits: said in one line (a user's sweep found it silent)."""
    from utils.models import kernel_choice

    monkeypatch.setattr(KernelChoice, "kernel", lambda self, form, out_features, in_features, widths=None:
                        "bf16" if isinstance(form, torch.Tensor) else kernel_choice.kernels_for(form)[0])
    native(files["qwen2"], cache_dir=tmp_path)
    notes = [line for line in capsys.readouterr().err.splitlines() if "bfloat16" in line]
    assert notes == ["note: 2 layers of type F16 run in bfloat16, measured fastest here (values rounded to it; "
                     "--kernels f32 keeps them exact)"], notes


def test_bfloat16_layers_run_in_bfloat16_without_a_rounding_note(files, tmp_path, capsys, monkeypatch):
    """A BF16 file's layers lose nothing in bfloat16: no "values rounded" note for them."""
    from utils.models import kernel_choice
    from gguf_models import TYPES

    monkeypatch.setattr(KernelChoice, "kernel", lambda self, form, out_features, in_features, widths=None:
                        "bf16" if isinstance(form, torch.Tensor) else kernel_choice.kernels_for(form)[0])
    path = write_tiny_gguf(tmp_path / "bf16.gguf", "qwen2", types={**TYPES, "ffn_up": Q.BF16, "ffn_gate": Q.F16})
    model = native(path, cache_dir=tmp_path)
    assert isinstance(model.model.layers[0].mlp.up_proj, Bf16Linear)
    notes = [line for line in capsys.readouterr().err.splitlines() if "bfloat16" in line]
    assert notes == ["note: 2 layers of type F16 run in bfloat16, measured fastest here (values rounded to it; "
                     "--kernels f32 keeps them exact)"], notes  # the F16 gate, not the BF16 up projection


def test_float_token_embeddings_keep_the_files_type(tmp_path):
    """F16 token embeddings stay the file's half-precision rows (decoded per looked-up row), not a float32 copy of
    twice the size; their rows are the float path's."""
    from gguf_models import TYPES

    path = write_tiny_gguf(tmp_path / "f16e.gguf", "qwen2", seed=0, types={**TYPES, "token_embd": Q.F16})
    model = native(path, "f32")
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, GGUFEmbedding) and embedding.type_name == "F16"
    torch.testing.assert_close(logits(model), logits(transformers_reference(path)), rtol=1e-4, atol=1e-4)


def test_auto_choice_is_measured_once_then_read_back(files, tmp_path):
    first = KernelChoice(tmp_path)
    build(*prepare(files["q4k"], first))
    assert first.measured > 0 and first.path.is_file()
    second = KernelChoice(tmp_path)
    model = build(*prepare(files["q4k"], second))
    assert second.measured == 0
    assert sum(kernel_counts(model).values()) == 2 * 7 + 1


def test_a_choice_file_damaged_inside_an_entry_is_measured_again(files, tmp_path):
    # valid JSON with a timing of the wrong type: TypeError while loading ("can't multiply sequence by float")
    import json

    first = KernelChoice(tmp_path)
    build(*prepare(files["q4k"], first))
    data = json.loads(first.path.read_text())
    key = next(iter(data["shapes"]))
    data["shapes"][key] = {"ms": {"gguf": {"1": "?", "9": 0.1}}}
    first.path.write_text(json.dumps(data))
    again = KernelChoice(tmp_path)
    build(*prepare(files["q4k"], again))
    assert again.measured == 1  # that shape alone


def test_a_long_layer_is_timed_on_a_slice_among_the_kernels_that_run_it_whole(monkeypatch):
    from utils.models import kernel_choice

    sliced = []
    real = kernel_choice.synthetic_form
    monkeypatch.setattr(kernel_choice, "MEASURED_ROWS", 32)
    monkeypatch.setattr(kernel_choice, "synthetic_form", lambda shape: sliced.append(shape) or real(shape))
    # 40 rows: torch's int4 packing needs a multiple of 16, so only the 32-row slice could run it
    timings = kernel_choice.measure(kernel_choice.Shape("Q4_1", 40, 256), candidates=("gguf", "bf16", "f32"))
    assert [s.out_features for s in sliced] == [32]
    assert timings and "int4" not in timings and set(timings) <= {"gguf", "bf16", "f32"}


def test_a_kernel_far_slower_when_hot_gets_no_cold_copies_and_a_slow_one_is_not_timed_wider(monkeypatch):
    """The hot screen (`SCREEN`) and the cold bound (`NEAR_TIE`) of `measure`, on fabricated times: each kernel
    takes the same time at every width, gguf the fastest."""
    from utils.models import kernel_choice, qkernels

    assert qkernels.ensure(cache_root()), qkernels.why()
    fake = {"gguf": 1.0, "int4": 3.0, "f32": 10.0}
    made, real_make = [], kernel_choice.make_linear
    monkeypatch.setattr(kernel_choice, "make_linear", lambda form, k: made.append(k) or real_make(form, k))
    monkeypatch.setattr(kernel_choice, "time_in_turns", lambda calls: {k: fake[k] for k in calls})
    timings = kernel_choice.measure(kernel_choice.Shape("Q4_K", 16, 256), candidates=("gguf", "int4", "f32"))
    # bound: gguf's weighted pass, 1.0 + 0.25 * 1.0; hot, f32 (10 > 2.5 * 1.25) is left out before its copies
    assert made.count("f32") == 1 and made.count("int4") == made.count("gguf") == kernel_choice.MAX_COPIES
    assert timings == {"gguf": {1: 1.0, 9: 1.0}}  # cold, int4 (3 > 1.15 * 1.25) is not timed at 9 rows


def test_a_fast_kernel_whose_rows_depend_on_the_width_is_left_out_and_the_screen_bound_again(monkeypatch):
    """Invariance is checked after the hot screen, on the kernels it keeps, and only for torch's (ours are
    invariant by construction): int4, fabricated fastest but not invariant, is dropped and the screen's bound
    taken again from gguf, which then keeps f32 for the cold timing."""
    from utils.models import kernel_choice, qkernels

    assert qkernels.ensure(cache_root()), qkernels.why()
    fake = {"gguf": 2.0, "int4": 1.0, "f32": 4.0}
    checked = []
    monkeypatch.setattr(kernel_choice, "time_in_turns", lambda calls: {k: fake[k] for k in calls})
    kinds = {}
    real_make = kernel_choice.make_linear
    monkeypatch.setattr(kernel_choice, "make_linear", lambda form, k: kinds.setdefault(k, real_make(form, k)))
    by_module = lambda module: next(k for k, m in kinds.items() if m is module)
    monkeypatch.setattr(kernel_choice, "batch_invariant",
                        lambda module, n: checked.append(by_module(module)) or by_module(module) != "int4")
    timings = kernel_choice.measure(kernel_choice.Shape("Q4_K", 16, 256), candidates=("gguf", "int4", "f32"))
    # int4's bound 1.25 keeps gguf and int4 (f32: 4 > 2.5 * 1.25); without int4, gguf's 2.5 keeps f32 too
    assert checked == ["int4", "f32"]
    assert timings == {"gguf": {1: 2.0, 9: 2.0}}  # cold: f32 (4 > 1.15 * 2.5) is not timed at 9 rows


def test_unknown_architecture_falls_back(files, monkeypatch):
    from utils.models import gguf_native

    monkeypatch.setattr(gguf_native, "PLAIN_ARCHS", set())
    with pytest.raises(gguf_native.NativeUnsupported, match="qwen2"):
        native(files["qwen2"], "f32")


@pytest.mark.parametrize("kernels", ["gguf", "gguf8", "int4", "bf16", "f32"])
@torch.no_grad()
def test_logits_do_not_depend_on_the_pass_width(files, kernels):
    """A token's logits are bit-identical whether it is decoded alone with the cache, verified among others,
    or recomputed in a cache-off pass over the whole sequence."""
    model = native(files["qwen2"], kernels)
    ids = torch.tensor([PROMPT + [20, 21, 22, 23, 24, 25, 26, 27, 28]])
    whole = model(ids).logits[0]  # cache off: one pass over everything
    cache = new_cache(model)
    model(ids[:, : len(PROMPT)], past_key_values=cache, use_cache=True)
    steps = [model(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits[0, -1]
             for i in range(len(PROMPT), ids.shape[1])]
    cache = new_cache(model)
    model(ids[:, : len(PROMPT)], past_key_values=cache, use_cache=True)
    wide = model(ids[:, len(PROMPT):], past_key_values=cache, use_cache=True).logits[0]
    assert torch.equal(torch.stack(steps), wide)
    assert torch.equal(wide, whole[len(PROMPT):])


@pytest.fixture(scope="module", params=["gguf", "gguf8", "int4"])
def native_pair(files, request):
    """The lossless guarantees in every mode: our integer kernels on the file's layout and on 8 rows interleaved,
    and torch's int4 kernel (their fallback)."""
    kernels = request.param
    return native(files["qwen2"], kernels), native(files["drafter"], kernels, drafter_int4=True)


def test_the_int4_drafter_runs_four_bit_blocks_everywhere(native_pair):
    _, drafter = native_pair
    counts = set(kernel_counts(drafter))
    assert counts == {"int4"} or counts <= {"Q4_K", "Q4_0", "Q4_1", "Q4_Kx8", "Q4_1x8"}, counts
    # gguf: the file's layout (Q4_0 runs as Q4_1, the same weights); gguf8: interleaved
    assert counts in ({"int4"}, {"Q4_K", "Q4_1"}) or {"Q4_Kx8", "Q4_1x8"} & counts


@pytest.mark.parametrize("use_cache", [False, True])
def test_greedy_speculative_and_nasd_equal_autoregressive(native_pair, use_cache):
    target, drafter = native_pair
    reference = autoregressive_generate(PROMPT, target, max_gen_len=40, eos_tokens_id=-1, use_cache=use_cache)
    for gamma in (1, 4, 8):
        out, _ = speculative_generate(PROMPT, drafter, target, gamma=gamma, max_gen_len=40, eos_tokens_id=-1,
                                      use_cache=use_cache)
        assert out == reference
    out, _ = ngram_assisted_speculative_generate(PROMPT, NGramStorage(3, VOCAB), target, gamma=4, max_gen_len=40, eos_tokens_id=-1,
                           use_cache=use_cache)
    assert out == reference


@pytest.mark.parametrize("type_name, kernels", [("Q2_K", "gguf8"), ("Q3_K", "gguf8"), ("Q5_K", "gguf8"),
                                               ("IQ4_XS", "gguf8"), ("Q8_0", "gguf8"), ("IQ3_S", "gguf"),
                                               ("IQ3_XXS", "gguf"), ("IQ2_S", "gguf"), ("IQ2_XS", "gguf"),
                                               ("IQ2_XXS", "gguf"), ("IQ1_S", "gguf"), ("IQ1_M", "gguf")])
def test_files_of_each_interleaved_or_grid_type_keep_speculations_tokens(files, tmp_path, type_name, kernels):
    """Q2_K, Q3_K_M, Q5_K_M, IQ4_XS and Q8_0 files under gguf8: every projection interleaved (Q3_K_X8 and so on,
    interleaved.h), and greedy SD and NASD still give AR's tokens (each row's logits independent of the pass's
    width). The IQ grid types (no interleaved layout) in the file's."""
    from gguf import GGMLQuantizationType as Q

    from gguf_models import TYPES

    path = write_tiny_gguf(tmp_path / f"{type_name}.gguf", "qwen2", seed=8,
                           types={role: Q[type_name] for role in TYPES})
    target, drafter = native(path, kernels), native(files["drafter"], "gguf8", drafter_int4=True)
    assert set(kernel_counts(target)) == {f"{type_name}x8" if kernels == "gguf8" else type_name}
    for use_cache in (False, True):
        reference = autoregressive_generate(PROMPT, target, max_gen_len=30, eos_tokens_id=-1, use_cache=use_cache)
        out, _ = speculative_generate(PROMPT, drafter, target, gamma=5, max_gen_len=30, eos_tokens_id=-1,
                                      use_cache=use_cache)
        assert out == reference
        out, _ = ngram_assisted_speculative_generate(PROMPT, NGramStorage(3, VOCAB), target, gamma=4, max_gen_len=30,
                                                     eos_tokens_id=-1, use_cache=use_cache)
        assert out == reference


def test_a_drafter_that_is_the_target_accepts_every_draft(native_pair):
    target, _ = native_pair
    _, acceptance = speculative_generate(PROMPT, target, target, gamma=4, max_gen_len=20, eos_tokens_id=-1,
                                         use_cache=True)
    assert acceptance == 1.0


@pytest.mark.parametrize("name", ["multinomial", "topk"])
def test_sampled_speculative_follows_the_native_targets_distribution(files, name):
    # in the default mode, our integer kernels (the int4 fallback's sampling ran here before them, unchanged)
    target, drafter = native(files["qwen2"], "gguf"), native(files["drafter"], "gguf", drafter_int4=True)
    torch.manual_seed(5)
    processor = PROCESSORS[name]
    samples = sample_speculative(target, drafter, processor)
    assert chi_square_pvalue(samples, exact_distribution(target, processor, vocab=VOCAB)) > 1e-3


def test_a_type_without_any_kernel_runs_dequantized_with_a_note(tmp_path, capsys):
    from gguf import GGMLQuantizationType as Q

    from gguf_models import TYPES

    path = write_tiny_gguf(tmp_path / "tq1_0.gguf", "qwen2", seed=4, types={**TYPES, "ffn_up": Q.TQ1_0})
    model = native(path, "gguf")
    notes = [line for line in capsys.readouterr().err.splitlines() if "dequantized" in line]
    assert notes == ["note: 2 tensors of type TQ1_0 run dequantized (no native kernel for that type)"]  # one a type
    reference = transformers_reference(path)
    assert (logits(model) - logits(reference)).abs().max() < 0.1 * logits(reference).abs().max()
    native(path, "f32")  # every layer dequantized, as asked: no note
    assert not [line for line in capsys.readouterr().err.splitlines() if "dequantized" in line]


@pytest.mark.parametrize("kernels", ["gguf", "gguf8", "bf16", "f32"])
@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q5_K", "IQ4_XS", "IQ4_NL", "Q5_1", "IQ3_S", "IQ3_XXS",
                                       "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M"])
def test_k_types_without_a_torch_decoder_run_through_our_kernels_or_dequantized(files, tmp_path, kernels, type_name):
    """The types of Q2_K, Q3_K_M, Q5_K_M, IQ4_XS and IQ1-IQ3 files beside Q4_K and Q6_K: linear layers on our kernels (or
    decoded for torch's; under gguf8 Q2_K, Q3_K, Q5_K and IQ4_XS interleaved, the others as in the file), token embeddings kept as the
    file's blocks either way; f32 computes what transformers' GGUF loader computes."""
    from gguf import GGMLQuantizationType as Q

    from gguf_models import TYPES

    qtype = Q[type_name]
    path = write_tiny_gguf(tmp_path / f"{type_name}.gguf", "qwen2", seed=4,
                           types={**TYPES, "ffn_up": qtype, "token_embd": qtype})
    model = native(path, kernels)
    up = model.model.layers[0].mlp.up_proj
    assert isinstance(up, {"gguf": GGUFLinear, "gguf8": GGUFLinear, "bf16": Bf16Linear,
                           "f32": (PackedLinear, torch.nn.Linear)}[kernels])
    if kernels == "gguf8":
        assert up.interleaved == (type_name in qkernels.X8)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, GGUFEmbedding) and embedding.type_name == type_name
    ours, theirs = logits(model), logits(transformers_reference(path))
    if kernels == "f32":
        assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()
    else:  # 8-bit activations or bfloat16 weights on a random model: 3-6% on average (a wrong decode: ~100%)
        assert (ours - theirs).abs().mean() < 0.1 * theirs.abs().mean()


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "IQ4_XS", "IQ3_S", "IQ2_XXS", "IQ1_S"])
def test_an_int4_drafter_keeps_types_of_at_most_four_and_a_half_bits(files, tmp_path, type_name):
    """Re-quantised to Q4_1 (5 bits a weight), a Q3_K layer would grow and be rounded twice."""
    from gguf import GGMLQuantizationType as Q

    from gguf_models import TYPES

    path = write_tiny_gguf(tmp_path / f"{type_name}.gguf", "qwen2", seed=4, types={**TYPES, "ffn_up": Q[type_name]})
    drafter = native(path, "gguf", drafter_int4=True)
    assert drafter.model.layers[0].mlp.up_proj.type_name == type_name


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_gguf_file_is_one_line(files, tmp_path, damage, monkeypatch):
    from utils.models.model_loader import ModelLoadError, load_model

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    data = files["qwen2"].read_bytes()
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data[: len(data) // 3] if damage == "truncated" else b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelLoadError) as error:
        load_model(str(path), device="cpu", progress=False)
    assert "\n" not in str(error.value) and "damaged.gguf" in str(error.value)


@pytest.mark.parametrize("short", ["head", "embedding"])
def test_a_head_or_embedding_short_of_the_vocabulary_is_a_damaged_file(tmp_path, monkeypatch, short):
    # float32 mode refused both; native mode ran a 48-row head for 96 tokens (half the vocabulary never written)
    # and failed a short embedding's first token past it, blaming the input
    import gguf_models
    from utils.models.gguf_native import GGUFFileError

    real, seen = gguf_models.tensor_data, []

    def tensor_data(rng, qtype, rows, cols):  # the vocabulary's tensors: the embedding first, then the head
        if rows == VOCAB:
            seen.append(rows)
            if len(seen) == (2 if short == "head" else 1):
                rows = VOCAB // 2
        return real(rng, qtype, rows, cols)

    monkeypatch.setattr(gguf_models, "tensor_data", tensor_data)
    path = write_tiny_gguf(tmp_path / "short.gguf")
    assert len(seen) == 2
    with pytest.raises(GGUFFileError, match=rf"holds {VOCAB // 2}x\d+ weights .* a damaged or wrongly converted file"):
        prepare(path, KernelChoice(None, "gguf"))


@pytest.mark.parametrize("tied", [False, True])
def test_a_head_and_embedding_padded_past_the_vocabulary_load_with_the_unpadded_logits(files, tmp_path, tied):
    """Only the head and the token embeddings may hold rows past the metadata's vocabulary (a head padded for the
    kernels): such a file loads, and its logits over the real vocabulary are those of the unpadded file."""
    padded = write_tiny_gguf(tmp_path / "padded.gguf", "qwen2", seed=2 if tied else 0, tied=tied, padded=32)
    model = native(padded, "f32")
    assert model.config.vocab_size == VOCAB
    out = logits(model)
    assert out.shape[-1] == VOCAB + 32 and torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :VOCAB], logits(native(files["tied" if tied else "qwen2"], "f32")),
                               rtol=0, atol=0)


def test_token_embeddings_of_another_width_are_a_damaged_file(tmp_path, monkeypatch):
    """An embedding whose rows are not the model's width (the layers' are) is named, not read with the wrong
    width."""
    import gguf_models
    from gguf_models import TYPES
    from utils.models.gguf_native import GGUFFileError

    real = gguf_models.tensor_data

    def tensor_data(rng, qtype, rows, cols):  # the embedding, the first tensor written: half as wide
        return real(rng, qtype, rows, cols // 2 if qtype == Q.F32 and rows == VOCAB else cols)

    monkeypatch.setattr(gguf_models, "tensor_data", tensor_data)
    path = write_tiny_gguf(tmp_path / "narrow.gguf", types={**TYPES, "token_embd": Q.F32})
    with pytest.raises(GGUFFileError, match=r"tensor token_embd\.weight holds 96x128 weights .* model\.embed_tokens"):
        prepare(path, KernelChoice(None, "gguf"))


def test_a_long_file_name_is_prepared_under_a_shorter_folder_name(tmp_path, monkeypatch):
    # a 215-byte name: the whole preparation ran, then the folder's name (the stem and 55 bytes) passed NAME_MAX
    from utils.models.model_loader import load_model

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / ("m" * 215 + ".gguf"), tokenizer=True)
    load_model(str(path), device="cpu", int4_drafter=True, progress=False)
    assert [p.name[:101] for p in (tmp_path / "cache").iterdir() if p.name.startswith("m")] == ["m" * 100 + "-"]


def test_native_asked_for_a_model_that_is_not_gguf(tmp_path):
    from utils.models.model_loader import ModelLoadError, load_model

    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match="--dtype native runs GGUF models"):
        load_model(str(tmp_path / "m"), device="cpu", dtype="native", progress=False)


def test_a_short_layer_is_timed_on_as_many_rows_as_the_floor_among_the_kernels_that_run_it(monkeypatch):
    """A 256-row layer's call alone is mostly the call's own work, which a pass shares between q, k and v: timed
    alone, such layers took the file layout and the 1.5B decoded 1.12-1.17x slower (thirty-fifth pass)."""
    from utils.models import kernel_choice

    timed = []
    real = kernel_choice.synthetic_form
    monkeypatch.setattr(kernel_choice, "MIN_MEASURED_ROWS", 64)
    monkeypatch.setattr(kernel_choice, "synthetic_form", lambda shape: timed.append(shape) or real(shape))
    # 40 rows: no int4 (its packing needs a multiple of 16), though the 64 timed rows could run it
    timings = kernel_choice.measure(kernel_choice.Shape("Q4_1", 40, 256), candidates=("gguf", "bf16", "f32"))
    assert [(s.out_features, s.in_features) for s in timed] == [(64, 256)]
    assert timings and set(timings) <= {"gguf", "bf16", "f32"}
    kernel_choice.measure(kernel_choice.Shape("Q4_1", 96, 256), candidates=("gguf",))
    assert timed[-1].out_features == 96  # longer than the floor: as it is


def test_layers_timed_as_one_shape_are_measured_once_among_the_same_kernels(monkeypatch):
    """The 1.5B's q/o (1536 rows) and k/v (256) are all timed as 2048 rows: one measurement, not two noisy ones.
    A layer whose kernels differ (40 rows: no interleaved layout, no int4) is measured on its own."""
    from utils.models import kernel_choice
    from utils.models.gguf_blocks import synthetic_blocks

    timed = []
    monkeypatch.setattr(kernel_choice, "MIN_MEASURED_ROWS", 64)
    monkeypatch.setattr(kernel_choice, "measure", lambda shape, candidates: timed.append((shape, candidates)) or {
        k: {1: 1e-3 * (i + 1), 9: 2e-3 * (i + 1)} for i, k in enumerate(candidates)})
    choice = KernelChoice(None)
    first = choice.kernel(synthetic_blocks("Q4_K", 48, 256), 48, 256)
    assert choice.kernel(synthetic_blocks("Q4_K", 16, 256), 16, 256) == first
    assert len(timed) == 1 and set(choice.decisions) == {"Q4_K:48x256", "Q4_K:16x256"}
    choice.kernel(synthetic_blocks("Q4_K", 40, 256), 40, 256)
    assert len(timed) == 2 and set(timed[1][1]) < set(timed[0][1])  # fewer kernels run 40 rows
    choice.kernel(synthetic_blocks("Q4_K", 80, 256), 80, 256)  # longer than the floor: timed as it is
    assert len(timed) == 3 and choice.measured == 3


def test_pick_weighs_widths_and_prefers_smaller_weights_on_a_near_tie():
    from utils.models.kernel_choice import TARGET_WIDTHS, pick

    ms = {"int4": {"1": 0.25, "9": 1.1}, "bf16": {"1": 0.66, "9": 0.8}, "f32": {"1": 1.3, "9": 1.5}}
    assert pick(ms, TARGET_WIDTHS) == "int4" and pick(ms, {1: 1.0}) == "int4"
    assert pick(ms, {9: 1.0}) == "bf16"  # verification alone: bf16 is 27% faster
    assert pick({"bf16": {"1": 1.0}, "f32": {"1": 0.95}}, {1: 1.0}) == "bf16"  # 5% slower, half the bytes


def test_every_layer_weighs_its_wide_passes_the_drafter_s_too():
    """The 0.5B's Q4_K 896x4864 as timed on the Zen 3 (ms): 8% slower interleaved at one row, 24% faster at nine.
    The drafter's one-row weights alone took the file layout, twice gguf8's time in the chat's 60-row passes;
    `prepare` now asks every layer for `TARGET_WIDTHS`' choice."""
    from utils.models.kernel_choice import TARGET_WIDTHS, pick

    ms = {"gguf": {"1": 0.218, "9": 0.6074}, "gguf8": {"1": 0.2364, "9": 0.4642}}
    assert pick(ms, {1: 1.0}) == "gguf" and pick(ms, TARGET_WIDTHS) == "gguf8"


def test_pick_takes_the_faster_of_two_kernels_of_the_same_memory_class():
    from utils.models.kernel_choice import pick

    ms = {"gguf": {"1": 1.0}, "gguf8": {"1": 0.9}, "int4": {"1": 0.85}}
    assert pick(ms, {1: 1.0}) == "gguf8"  # int4 is 6% faster but larger; gguf8 beats gguf in its class
    assert pick({"gguf": {"1": 0.95}, "gguf8": {"1": 1.0}}, {1: 1.0}) == "gguf"
    assert pick({"gguf": {"1": 2.0}, "gguf8": {"1": 1.9}, "bf16": {"1": 1.0}}, {1: 1.0}) == "bf16"


def test_interleaved_blocks_are_offered_for_their_types_in_whole_groups_of_8_rows():
    from utils.models.gguf_blocks import synthetic_blocks
    from utils.models.native_linear import kernels_for, linear_from_state, linear_state
    from utils.models import qkernels

    assert qkernels.ensure(cache_root())
    assert "gguf8" in kernels_for(synthetic_blocks("Q4_K", 16, 256))
    assert "gguf8" not in kernels_for(synthetic_blocks("Q4_K", 12, 256))
    assert "gguf8" in kernels_for(synthetic_blocks("Q6_K", 16, 256))  # the 1.5B's head and half its down projections
    assert "gguf8" in kernels_for(synthetic_blocks("Q8_0", 16, 256))  # Q8_0 and Q5_K files
    assert "gguf8" in kernels_for(synthetic_blocks("Q5_K", 16, 256))
    assert "gguf8" in kernels_for(synthetic_blocks("Q3_K", 16, 256))  # Q3_K_M files
    assert "gguf8" in kernels_for(synthetic_blocks("IQ4_XS", 16, 256))
    assert "gguf8" in kernels_for(synthetic_blocks("Q2_K", 16, 256))
    assert "gguf8" not in kernels_for(synthetic_blocks("Q5_0", 16, 256))  # no interleaved layout
    assert "gguf8" in kernels_for(synthetic_blocks("Q4_1", 16, 256))  # the re-quantised drafter's type
    for type_name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "IQ4_XS", "Q8_0"):
        form = synthetic_blocks(type_name, 16, 512, generator=torch.Generator().manual_seed(3))
        plain = linear_from_state("gguf", linear_state(form, "gguf"), None, 512, type_name)
        x8 = linear_from_state("gguf8", linear_state(form, "gguf8"), None, 512, type_name)
        assert x8.label == f"{type_name}x8" and torch.equal(x8.file_rows(torch.arange(16)), form.data)
        some = torch.tensor([13, 2, 9, 2])  # any rows, any order, repeats: only their groups are converted back
        assert torch.equal(x8.file_rows(some), form.data[some])
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
        # Same products, summed in another order: float32 rounding up to ~1e-7 of the sums' size, also in the
        # entries near zero (an elementwise rtol alone failed such draws now and then: 11 of 960 here, and once
        # on an Intel host).
        expected = plain(x)
        assert torch.allclose(x8(x), expected, rtol=0, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("kernels, drafter_int4", [(None, False), ("int4", False), (None, True), ("int4", True)])
def test_a_vocabulary_that_is_no_multiple_of_16_loads(tmp_path, monkeypatch, kernels, drafter_int4):
    """torch's int4 packing needs a multiple of 16 output rows: a 100-token head (granite has 49155) must not be
    offered to it, measured, forced or re-quantised for it (issue 25, item 5)."""
    import gguf_models

    monkeypatch.setattr(gguf_models, "VOCAB", 100)
    path = write_tiny_gguf(tmp_path / "v100.gguf", "qwen2", seed=6, types=ALL_Q4K)
    model = native(path, kernels, drafter_int4=drafter_int4, cache_dir=tmp_path)
    assert not isinstance(model.lm_head, Int4Linear)
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), use_cache=False).logits
    assert out.shape[-1] == 100 and torch.isfinite(out).all()


def test_an_int4_drafter_keeps_float_layers_whose_rows_are_no_whole_groups(tmp_path, monkeypatch):
    """A float layer whose input width is no multiple of the int4 group (32) stays as it is in an int4 drafter;
    the others are re-quantised."""
    import gguf_models

    monkeypatch.setattr(gguf_models, "HIDDEN", 80)
    monkeypatch.setattr(gguf_models, "HEAD_DIM", 20)
    path = write_tiny_gguf(tmp_path / "h80.gguf", "qwen2", seed=7, types=dict.fromkeys(gguf_models.TYPES, Q.F32))
    model = native(path, drafter_int4=True, cache_dir=tmp_path)
    layer = model.model.layers[0]
    assert not isinstance(layer.self_attn.q_proj, (GGUFLinear, Int4Linear))  # 80 inputs: kept float
    assert isinstance(layer.mlp.down_proj, (GGUFLinear, Int4Linear))  # 512 inputs: re-quantised
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([PROMPT]), use_cache=False).logits).all()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_tokenizer_read_for_its_known_type_equals_autotokenizers(arch, tmp_path):
    """Preparation reads a file's tokenizer through the class its model type names (AutoTokenizer would parse
    the metadata again to learn the type): the same class, ids and saved files."""
    from transformers import AutoTokenizer

    from utils.models.model_loader import gguf_tokenizer

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tokenizer=True)
    auto = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    ours = gguf_tokenizer(path, arch)
    assert type(ours) is type(auto) and ours.get_vocab() == auto.get_vocab()
    text = "def f(x):\n    return x + 1  # ü"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    auto.save_pretrained(tmp_path / "auto")
    ours.save_pretrained(tmp_path / "ours")
    for saved in (tmp_path / "auto").iterdir():
        assert saved.read_bytes() == (tmp_path / "ours" / saved.name).read_bytes()
    assert type(gguf_tokenizer(path, None)) is type(auto)  # no type: AutoTokenizer itself


def test_a_second_file_with_the_same_vocabulary_reuses_the_parsed_tokenizer_with_its_template(tmp_path, monkeypatch):
    """The embedded drafter's tokenizer metadata is the target's but for its chat template: `file_tokenizer`
    parses it once, and each file's saved tokenizer is byte for byte a fresh parse's."""
    from utils.models import model_loader

    other_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    # "none" (no template) is not "first" with its template removed: parsed again; "types": another vocabulary
    files = {"first": True, "template": {"chat_template": other_template}, "none": {"chat_template": None},
             "none too": {"chat_template": None}, "types": {"controls": 4}}
    parses = []
    monkeypatch.setattr(model_loader, "_last_tokenizer", [None] * 4)  # none parsed yet, whatever ran before
    real = model_loader.gguf_tokenizer
    monkeypatch.setattr(model_loader, "gguf_tokenizer", lambda path, kind: parses.append(path.stem) or real(path, kind))
    for name, tokenizer in files.items():
        path = write_tiny_gguf(tmp_path / f"{name}.gguf", tokenizer=tokenizer)
        model_loader.file_tokenizer(path, "qwen2").save_pretrained(tmp_path / name / "reused")
        real(path, "qwen2").save_pretrained(tmp_path / name / "fresh")
        fresh = sorted(p.name for p in (tmp_path / name / "fresh").iterdir())
        assert sorted(p.name for p in (tmp_path / name / "reused").iterdir()) == fresh
        for saved in fresh:
            assert (tmp_path / name / "reused" / saved).read_bytes() == (tmp_path / name / "fresh" / saved).read_bytes()
    assert parses == ["first", "none", "types"]
    assert ("chat_template.jinja" in os.listdir(tmp_path / "none" / "fresh")) is False


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_one_tensor_name_map_gives_transformers_mapping_and_restores_gguf(tmp_path, arch):
    """prepare builds gguf's name table once for transformers' recursive mapping: the same mapping as without,
    and gguf's function is itself again afterwards, also after an error."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map
    from utils.models.gguf_config import gguf_config
    from utils.models.gguf_native import empty_model, one_tensor_name_map

    model = empty_model(gguf_config(write_tiny_gguf(tmp_path / f"{arch}.gguf", arch)))
    original = gguf.get_tensor_name_map
    plain = get_gguf_hf_weights_map(model, TensorProcessor())
    with one_tensor_name_map():
        assert gguf.get_tensor_name_map is not original
        once = get_gguf_hf_weights_map(model, TensorProcessor())
        assert gguf.get_tensor_name_map.cache_info().misses == 1  # one table for every submodule
    assert once == plain and len(plain) > 0 and gguf.get_tensor_name_map is original
    with pytest.raises(RuntimeError), one_tensor_name_map():
        raise RuntimeError("a failed preparation")
    assert gguf.get_tensor_name_map is original


def test_a_gguf_file_whose_name_is_not_utf8_loads(tmp_path, monkeypatch):
    """A sweep found a legal POSIX name that is not UTF-8 (Latin-1 `caf\xe9.gguf`) failing to prepare with a
    UnicodeEncodeError: the tokenizers library writes only to UTF-8 paths, and the prepared folder was named after
    the file."""
    from pathlib import Path

    from utils.models.model_loader import load_model

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    utf8 = write_tiny_gguf(tmp_path / "cafe.gguf", tokenizer=True)
    path = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9.gguf"))
    path.write_bytes(utf8.read_bytes())
    model, _ = load_model(str(path), device="cpu", progress=False)
    reference, _ = load_model(str(utf8), device="cpu", progress=False)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_a_gguf_file_missing_a_tensor_is_incomplete_at_once(tmp_path, monkeypatch):
    """A sweep found a file without one tensor said to run "dequantized in float32 instead", dequantized whole (minutes
    for a real model), then refused as partly random after transformers' LOAD REPORT: a file transformers' own reader
    looks for that tensor in is incomplete, in one line, before any float work."""
    from gguf import GGUFWriter

    from utils.models.model_loader import ModelLoadError, load_model

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    add_tensor = GGUFWriter.add_tensor
    monkeypatch.setattr(GGUFWriter, "add_tensor", lambda self, name, *args, **kwargs: (
        None if name == "blk.1.ffn_down.weight" else add_tensor(self, name, *args, **kwargs)))
    path = write_tiny_gguf(tmp_path / "missing.gguf", tokenizer=True)
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=r"missing\.gguf has no tensor blk\.1\.ffn_down\.weight \(for model\.layers"
                                             r"\.1\.mlp\.down_proj\.weight\): the file is incomplete") as error:
        load_model(str(path), device="cpu", progress=False)
    assert "\n" not in str(error.value)
    assert not list((tmp_path / "cache").glob("*float32*"))  # no dequantized copy was made on the way


@pytest.mark.parametrize("damage, message", [
    ("add_eos_token_id", r"eos\.gguf is not a readable GGUF file: tokenizer\.ggml\.eos_token_id is 5000, past its "
                         r"\d+ tokens$"),
    ("add_head_count", r"head_count\.gguf: tensor blk\.0\.attn_q\.weight holds 256x256 weights where the file's "
                       r"metadata make model\.layers\.0\.self_attn\.q_proj\.weight 255x256 \(head count, sizes\)"),
])
def test_metadata_that_do_not_fit_the_file_are_named(tmp_path, monkeypatch, damage, message):
    """A sweep found an end token's id past the token list ("IndexError: list index out of range") and a head count
    that does not divide the width (a kernel's "the row length must be a multiple of 32, got 255")."""
    from gguf import GGUFWriter

    from utils.models.model_loader import ModelLoadError, load_model

    original = getattr(GGUFWriter, damage)
    monkeypatch.setattr(GGUFWriter, damage, lambda self, value: original(self, 5000 if "eos" in damage else 3))
    path = write_tiny_gguf(tmp_path / ("eos.gguf" if "eos" in damage else "head_count.gguf"), tokenizer=True)
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path), device="cpu", progress=False)
    if "eos" in damage:  # the float path reads the same metadata through transformers' own tokenizer loading
        with pytest.raises(ModelLoadError, match=message):
            load_model(str(path), device="cpu", dtype="float32", progress=False)


def test_the_cpu_line_counts_its_threads_in_words(monkeypatch):
    """A sweep: `taskset -c 0` showed "1 threads" on the start line."""
    from utils.models.kernel_choice import describe_cpu

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert describe_cpu().endswith(", 1 thread")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert describe_cpu().endswith(", 2 threads")


def test_a_file_whose_tokenizer_differs_beyond_its_tokens_is_parsed_again(tmp_path, monkeypatch):
    """Two files with one token list but other token types (which tokens are control tokens), parsed one after the
    other: the second must not be given the first's tokenizer with only its chat template changed."""
    from utils.models import model_loader

    monkeypatch.setattr(model_loader, "_last_tokenizer", [None] * 4)
    first = write_tiny_gguf(tmp_path / "first.gguf", tokenizer=True)
    other = write_tiny_gguf(tmp_path / "types.gguf", tokenizer={"controls": 4})
    model_loader.file_tokenizer(first, "qwen2")
    model_loader.file_tokenizer(other, "qwen2").save_pretrained(tmp_path / "reused")
    model_loader.gguf_tokenizer(other, "qwen2").save_pretrained(tmp_path / "fresh")
    fresh = sorted(p.name for p in (tmp_path / "fresh").iterdir())
    assert sorted(p.name for p in (tmp_path / "reused").iterdir()) == fresh
    for saved in fresh:
        assert (tmp_path / "reused" / saved).read_bytes() == (tmp_path / "fresh" / saved).read_bytes(), saved
