"""What the kernel choice and the kernels' build are keyed on, which saved decisions are read back, and the one-line
answers where no kernel or no build is possible (tests found missing by mutation testing)."""

import json

import pytest
import torch

from utils.models import kernel_choice, qkernels
from utils.models.cpu_kernels import PackedLinear, one_row_as_two, packing_available
from utils.models.kernel_choice import KernelChoice, batch_invariant


def fake_measure(timed):
    return lambda shape, candidates: timed.append(shape) or {
        k: {1: 1e-3 * (i + 1), 9: 2e-3 * (i + 1)} for i, k in enumerate(candidates)}


def test_the_choice_file_is_keyed_on_the_cpu_flags_torch_and_threads(monkeypatch):
    """Two CPUs of one model name with other vector extensions (AVX-512 or AMX off in a VM, say) rank the kernels
    differently: a decision timed on one is not read on the other, nor under another torch or thread count."""
    def digest():
        return KernelChoice(None).digest

    monkeypatch.setattr(kernel_choice, "cpu_fields", lambda: {"model name": "Some CPU", "flags": "avx2 fma"})
    avx2 = digest()
    monkeypatch.setattr(kernel_choice, "cpu_fields", lambda: {"model name": "Some CPU", "flags": "avx2 fma amx_tile"})
    amx = digest()
    assert amx != avx2
    # one model name, two generations ("AMD EPYC": Zen 4 and Zen 5, whose kernels rank differently)
    epyc = {"model name": "AMD EPYC", "cpu family": "25", "model": "17", "flags": "avx2 fma amx_tile"}
    monkeypatch.setattr(kernel_choice, "cpu_fields", lambda: epyc)
    zen4 = digest()
    monkeypatch.setattr(kernel_choice, "cpu_fields", lambda: {**epyc, "cpu family": "26", "model": "2"})
    assert digest() != zen4
    monkeypatch.setattr(kernel_choice, "cpu_fields", lambda: {"model name": "Some CPU", "flags": "avx2 fma amx_tile"})
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    other_torch = digest()
    assert other_torch != amx
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    assert digest() != other_torch


def test_a_choice_file_written_for_another_machine_is_not_read(tmp_path):
    choice = KernelChoice(tmp_path)
    shapes = {"int:16x64": {"ms": {"bf16": {"1": 1.0, "9": 1.0}, "f32": {"1": 2.0, "9": 2.0}}}}
    choice.path.write_text(json.dumps({"machine": {**choice.description, "cpu": "another"}, "shapes": shapes}))
    assert KernelChoice(tmp_path).decisions == {}
    choice.path.write_text(json.dumps({"machine": choice.description, "shapes": shapes}))
    assert KernelChoice(tmp_path).decisions == shapes  # the control: this machine's is read


def test_a_saved_entry_naming_a_kernel_the_layer_cannot_run_is_measured_again(tmp_path, monkeypatch):
    """A float weight runs in bf16 or f32 only: a saved entry offering int4 (a file edited or damaged) is timed
    again rather than picked from (int4, the smallest, would win and the layer could not be made)."""
    timed = []
    monkeypatch.setattr(kernel_choice, "measure", fake_measure(timed))
    weight = torch.randn(16, 64)
    choice = KernelChoice(tmp_path)
    ms = {k: {"1": 1.0, "9": 1.0} for k in ("int4", "bf16", "f32")}
    choice.path.write_text(json.dumps({"machine": choice.description, "shapes": {"int:16x64": {"ms": ms}}}))
    again = KernelChoice(tmp_path)
    assert "int:16x64" in again.decisions
    assert again.kernel(weight, 16, 64) in kernel_choice.kernels_for(weight)
    assert again.measured == 1 and len(timed) == 1
    # an entry with no timings at all: measured again too (picking from it raised "min() arg is an empty sequence")
    choice.path.write_text(json.dumps({"machine": choice.description, "shapes": {"int:16x64": {"ms": {}}}}))
    assert KernelChoice(tmp_path).kernel(weight, 16, 64) in ("bf16", "f32") and len(timed) == 2


@pytest.mark.parametrize("shapes", [[], None, "x"])
def test_a_choice_file_whose_shapes_are_not_an_object_is_measured_again(tmp_path, monkeypatch, shapes):
    """Valid JSON damaged inside: every decision looked up in it failed with an AttributeError, at every start."""
    timed = []
    monkeypatch.setattr(kernel_choice, "measure", fake_measure(timed))
    choice = KernelChoice(tmp_path)
    choice.path.write_text(json.dumps({"machine": choice.description, "shapes": shapes}))
    assert KernelChoice(tmp_path).kernel(torch.randn(16, 64), 16, 64) in ("bf16", "f32") and len(timed) == 1


def test_no_batch_invariant_kernel_is_a_one_line_error_not_an_empty_pick(monkeypatch):
    monkeypatch.setattr(kernel_choice, "measure", lambda shape, candidates: {})
    with pytest.raises(RuntimeError, match=r"no kernel gives batch-invariant results for int:16x64 on this CPU; "
                                           r"run with --kernels f32 or --dtype float32"):
        KernelChoice(None).kernel(torch.randn(16, 64), 16, 64)


class WidthDependent(torch.nn.Module):
    """x * 2, off by one at a call of `bad` rows (None: never)."""

    def __init__(self, bad):
        super().__init__()
        self.bad = bad

    def forward(self, x):
        return x * 2 + (1 if x.shape[0] == self.bad else 0)


def test_batch_invariance_compares_one_and_two_rows_with_the_wide_call():
    """One row against two or more is where oneDNN switches from a matrix-vector to a matrix-matrix kernel: a
    decoding pass's logits then differ from a verification pass's."""
    assert batch_invariant(WidthDependent(None), 8)
    for bad in (1, 2, 9):
        assert not batch_invariant(WidthDependent(bad), 8), bad


def test_one_row_is_computed_as_a_pair_so_packed_layers_are_batch_invariant():
    rows = []
    y = one_row_as_two(lambda x: rows.append(x.shape[0]) or x * 3, torch.ones(1, 1, 4))
    assert rows == [2] and y.shape == (1, 1, 4) and torch.equal(y, torch.full((1, 1, 4), 3.0))
    assert one_row_as_two(lambda x: rows.append(x.shape[-2]) or x, torch.ones(1, 3, 4)).shape == (1, 3, 4)
    assert rows == [2, 3]
    if packing_available():
        torch.manual_seed(0)
        assert batch_invariant(PackedLinear(torch.nn.Linear(1536, 1536)), 1536)


def test_the_kernels_build_key_names_the_cpu_and_torch(monkeypatch):
    """A build with `-march=native` for one CPU ends another's process (SIGILL): the key, and so the folder, differ."""
    monkeypatch.setattr(kernel_choice, "cpu_facts", lambda: {"cpu": "A", "flags": ["avx2"]})
    a = qkernels.build_key("c++ 1.0", "c++")
    assert qkernels.build_key("c++ 1.0", "c++") == a
    monkeypatch.setattr(kernel_choice, "cpu_facts", lambda: {"cpu": "A", "flags": ["avx2", "avx512f"]})
    wider = qkernels.build_key("c++ 1.0", "c++")
    assert wider != a
    assert qkernels.build_key("c++ 2.0", "c++") != wider
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert qkernels.build_key("c++ 1.0", "c++") != wider


def test_a_failed_build_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    """A compile error (cpp_extension raises RuntimeError) leaves the kernels unused with the error's line."""
    monkeypatch.setattr(qkernels, "_state", {"loaded": False, "why": None, "key": None, "ops": None})
    monkeypatch.delenv("SPECDEC_QKERNELS_DIR", raising=False)
    monkeypatch.delenv("SPECDEC_QKERNELS", raising=False)
    monkeypatch.setattr(qkernels, "compiler_version", lambda cxx: "c++ (a compiler never used before) 99")

    def failing_build(*args, **kwargs):
        raise RuntimeError("Error building extension 'specdec_qkernels'\nqkernels.cpp:1:1: error: no such thing")

    monkeypatch.setattr(qkernels, "build", failing_build)
    assert qkernels.ensure(tmp_path, progress=False) is False
    assert qkernels.why() == ("the kernel build failed (qkernels.cpp:1:1: error: no such thing); "
                              "SPECDEC_QKERNELS_VERBOSE=1 shows the compiler")


def test_kernels_switched_off_are_neither_built_nor_loaded(tmp_path, monkeypatch):
    """SPECDEC_QKERNELS=off: torch's kernels on purpose, without a compile (nor the wait a first start announces)."""
    monkeypatch.setattr(qkernels, "_state", {"loaded": False, "why": None, "key": None, "ops": None})
    monkeypatch.delenv("SPECDEC_QKERNELS_DIR", raising=False)
    monkeypatch.setenv("SPECDEC_QKERNELS", "Off")
    monkeypatch.setattr(qkernels, "compiler_version", lambda cxx: "c++ (a compiler never used before) 99")
    monkeypatch.setattr(qkernels, "build", lambda *args, **kwargs: pytest.fail("built though switched off"))
    assert qkernels.will_build(tmp_path) is False
    assert qkernels.ensure(tmp_path, progress=False) is False
    assert qkernels.why() == "disabled by SPECDEC_QKERNELS=off" and not qkernels.loaded()
