"""Builds a model from a GGUF file with its weights kept at the file's own precision.

The config is transformers' (read from the GGUF metadata); the module tree is our own for Qwen2 and Llama
(`native_tree.py`, transformers' module names) and transformers' for other architectures (built empty with
accelerate's `init_empty_weights`); its linear layers become the native layers of `native_linear.py`, its
token embeddings keep the file's blocks, and its float tensors (norms, biases) are copied as they are. GGUF
tensor names map to transformers' through transformers' own `get_gguf_hf_weights_map`.

Where a GGUF tensor goes:

| GGUF type | decoded as | kernels it can run on |
| --- | --- | --- |
| Q4_K, Q4_0, Q4_1 | 4-bit values, scale and minimum per 32 | gguf, gguf8 (Q4_K, Q4_1; Q4_0 runs as Q4_1), int4 (exact values; scale and zero rounded to bfloat16), bf16, f32 |
| Q8_0, Q5_0, Q6_K | signed values, scale per 32 (Q6_K: per 16) | gguf, gguf8 (Q6_K, Q8_0), bf16 (weights rounded to bfloat16), f32 (exact) |
| Q2_K, Q3_K, Q5_K, Q5_1, IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS, IQ1_S, IQ1_M | kept as the file's blocks | gguf, gguf8 (Q2_K, Q3_K, Q5_K, IQ4_XS), bf16, f32; without the built kernels, dequantized as the row below |
| F32, F16, BF16 | float | bf16, f32 |
| any other type the `gguf` package reads | dequantized by `gguf.quants.dequantize`, with one note line per type | bf16, f32 |
| token embeddings, any of the above | the file's blocks, decoded per looked-up row (other types: kept decoded) | exact (float32) |
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from utils.models.cpu_kernels import PackedLinear
from utils.models import mapped_pages, qkernels
from utils.models.gguf_config import gguf_config
from utils.models.gguf_blocks import (BLOCK_LAYOUT, DECODERS, FLOAT_TYPES, Int4Groups, RawBlocks, decode,
                                      package_dequantized, q4_0_as_q4_1)
from utils.models.kernel_choice import KernelChoice
from utils.models.native_linear import (INT4_GROUP, X8_ROWS, Bf16Linear, GGUFEmbedding, GGUFLinear, Int4Linear,
                                        linear_from_state, linear_state, requantize_int4, requantize_q4_1)
from utils.models.native_tree import NativeCausalLM, tree_applicable
from utils.models.rowwise_attention import use_rowwise_attention

# Architectures whose GGUF tensors need no reordering on the way to transformers (transformers applies no
# TensorProcessor to them), and llama-style ones whose q/k rows llama.cpp's converter permuted.
PLAIN_ARCHS = {"qwen2", "qwen3", "mistral", "phi3", "starcoder2", "olmo", "olmo2", "granite"}
PERMUTED_QK_ARCHS = {"llama"}


class NativeUnsupported(Exception):
    """This GGUF file cannot run natively; the caller falls back to the dequantizing float path."""


class GGUFFileError(Exception):
    """The file is not a readable GGUF file (truncated, corrupt); the message is one line."""


def file_tensors(path: Path) -> list:
    """The tensors (name, tensor_type, shape, data) of the GGUF model `path`, from every part of a split one, each
    header checked first: the reader trusts the header's counts, and a hostile one makes it loop without end.
    Little-endian files are read from the checked table (gguf_header.read_tensors); the reader's full parse is
    kept for the other byte order."""
    from utils.models.gguf_header import GGUFHeaderError, split_parts

    try:
        parts = split_parts(path)
    except GGUFHeaderError as error:
        raise GGUFFileError(f"{path} is not a readable GGUF file ({error})") from None
    tensors = [tensor for part in parts for tensor in part_tensors(part)]
    names = Counter(tensor.name for tensor in tensors)
    if len(parts) > 1 and (twice := [name for name, n in names.items() if n > 1]):
        raise GGUFFileError(f"{path} is not a readable GGUF file (tensor {twice[0]} is in two of its parts)")
    return tensors


def part_tensors(path: Path) -> list:
    """One file's tensors (`file_tensors`)."""
    from gguf import GGUFReader

    from utils.models.gguf_header import GGUFHeaderError, read_tensors

    try:
        tensors = read_tensors(path)
    except GGUFHeaderError as error:
        raise GGUFFileError(f"{path} is not a readable GGUF file ({error})") from None
    if tensors is not None:
        return tensors
    try:
        return list(GGUFReader(str(path)).tensors)
    except Exception as error:  # the reader raises ValueError, IndexError, struct errors on damaged files
        raise GGUFFileError(f"{path} is not a readable GGUF file ({type(error).__name__}: "
                            f"{str(error).splitlines()[0] if str(error) else 'damaged'})") from error


def tensor_form(tensor, dequantized):
    """A GGUF tensor -> its decoded form (Int4Groups / IntGroups) or a float tensor [rows, cols] / [n].
    `dequantized(type_name)` hears of each tensor that no kernel reads as it is."""
    type_name = tensor.tensor_type.name
    if type_name in DECODERS or type_name in FLOAT_TYPES:
        form = decode(type_name, np.asarray(tensor.data))
        return form.float() if isinstance(form, torch.Tensor) else form
    dequantized(type_name)
    try:
        return package_dequantized(type_name, np.asarray(tensor.data))
    except NotImplementedError as error:
        raise NativeUnsupported(f"tensor {tensor.name} has type {type_name}, which the gguf package cannot "
                                f"read either") from error


def linear_form(tensor, in_features: int, dequantized):
    """A linear layer's GGUF tensor -> its blocks as they are in the file (RawBlocks) where a kernel can read
    them (ours, or torch's after decoding), else its dequantized form (with a note)."""
    type_name = tensor.tensor_type.name
    if type_name in DECODERS or (type_name in BLOCK_LAYOUT and qkernels.loaded()):
        data = torch.from_numpy(np.array(tensor.data))  # a copy: the reader maps the file read-only
        return RawBlocks(type_name, data.reshape(data.shape[0], -1), in_features)
    return tensor_form(tensor, dequantized)


def reorder_qk_rows(form, heads: int):
    """Undo llama.cpp's q/k row permutation (as transformers' LlamaTensorProcessor does) on any form."""
    if isinstance(form, RawBlocks):  # rows of blocks are independent: permute them as they are
        return RawBlocks(form.type_name, reorder_qk_rows(form.data, heads), form.in_features)
    rows = (form.q if hasattr(form, "q") else form).shape[0]
    half = rows // heads // 2
    order = torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)
    if isinstance(form, torch.Tensor):
        return form[order]
    fields = {name: getattr(form, name)[order] if isinstance(getattr(form, name), torch.Tensor) else getattr(form, name)
              for name in form.__dataclass_fields__}
    return type(form)(**fields)


def module_sources(model, names: dict[str, str], tensors: dict) -> dict[str, str]:
    """transformers' parameter name -> GGUF tensor name, the output head falling back on tied embeddings."""
    hf_to_gguf = {hf: g for g, hf in names.items() if g in tensors}
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    if head_name and f"{head_name}.weight" not in hf_to_gguf and "token_embd.weight" in tensors:
        hf_to_gguf[f"{head_name}.weight"] = "token_embd.weight"  # tied: llama.cpp stores one table
    return hf_to_gguf


def empty_model(config):
    """transformers' module tree for `config` with parameters on the meta device (no memory, no init)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():  # buffers (rotary frequencies) stay real
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@contextmanager
def one_tensor_name_map():
    """transformers' `get_gguf_hf_weights_map` recurses into every submodule and asks gguf's
    `get_tensor_name_map(arch, layers)` for a fresh table each time (344 times for the 1.5B), which depends on its
    two arguments only: while it runs, gguf's function is memoised, so the table is built once. The same mapping
    (tested); on the Zen 3 of benchmarks/RESULTS.md the first start's two calls took 8.8 and 6.4 s, now 0.04 s each."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def prepare(gguf_path: Path, kernels: KernelChoice, drafter_int4: bool = False, note=None):
    """Reads a GGUF file into (config, layout, tensors): what `build` needs, and what the prepared cache holds.

    `layout` maps each replaced module to how it runs; `tensors` holds every tensor by `module.role`.
    With `drafter_int4`, tensors the int4 kernel cannot run as they are get re-quantised to it (lossy).
    """
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    note = note or (lambda text: print(text, file=sys.stderr, flush=True))
    config = gguf_config(gguf_path)
    arch = config.model_type
    if arch not in PLAIN_ARCHS | PERMUTED_QK_ARCHS:
        raise NativeUnsupported(f"no native path for the {arch} architecture yet")
    model = empty_model(config)
    tensors = {t.name: t for t in file_tensors(gguf_path)}
    # notes, one line per type rather than per tensor: tensors run dequantized; layers a forced kernel cannot run
    # ((type, kernel) instead); layers rounded to bfloat16 because it measured fastest
    dequantized, instead, rounded = Counter(), Counter(), Counter()
    with one_tensor_name_map():
        hf_names = get_gguf_hf_weights_map(model, TensorProcessor())
    sources = module_sources(model, hf_names, tensors)
    expected = {}  # transformers' parameter name -> the GGUF tensor its own reader looks for
    for gguf_name, hf_name in hf_names.items():
        expected.setdefault(hf_name, gguf_name)

    def missing(hf_name: str) -> Exception:
        """A tensor the file lacks: where transformers' reader would look for it too, the file is incomplete (its
        float path would dequantize the whole model, then refuse it as partly random); else our mapping lacks it."""
        if hf_name in expected:
            return GGUFFileError(f"{gguf_path} has no tensor {expected[hf_name]} (for {hf_name}): the file is "
                                 "incomplete (a vocabulary-only or damaged GGUF file)")
        return NativeUnsupported(f"the file has no tensor for {hf_name}")

    def form_of(hf_name: str, in_features: int | None = None):
        gguf_name = sources[hf_name]
        tensor = tensors[gguf_name]
        count = lambda type_name: dequantized.update([type_name])
        form = tensor_form(tensor, count) if in_features is None else linear_form(tensor, in_features, count)
        if arch in PERMUTED_QK_ARCHS and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
            form = reorder_qk_rows(form, heads)
        return form

    layout, state = {}, {}
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        weight = f"{name}.weight"
        if isinstance(module, torch.nn.Embedding) and weight in sources:
            tensor = tensors[sources[weight]]
            cols, rows = (int(n) for n in tensor.shape)
            if cols != module.embedding_dim or rows < module.num_embeddings:  # (float32 mode refuses it too)
                raise GGUFFileError(f"{gguf_path}: tensor {sources[weight]} holds {rows}x{cols} weights where the "
                                    f"file's metadata make {weight} {module.num_embeddings}x{module.embedding_dim}: "
                                    "a damaged or wrongly converted file")
            type_name = tensor.tensor_type.name
            if type_name in BLOCK_LAYOUT or type_name in FLOAT_TYPES:  # (every decoded type has a layout)
                state[weight] = torch.from_numpy(np.array(tensor.data))  # the file's blocks, copied off the mmap
            else:
                type_name, state[weight] = "F32", form_of(weight)  # no decoder: kept decoded
            layout[name] = {"kind": "embedding", "type": type_name, "dim": module.embedding_dim}
        elif isinstance(module, torch.nn.Linear):
            if weight not in sources:
                raise missing(weight)
            cols, rows = (int(n) for n in tensors[sources[weight]].shape)
            # the head may be padded past the vocabulary its metadata count (never short of it); every other layer is
            # exactly its shape
            if cols != module.in_features or rows < module.out_features or (rows > module.out_features
                                                                               and module is not head):
                raise GGUFFileError(f"{gguf_path}: tensor {sources[weight]} holds {rows}x{cols} weights where the "
                                    f"file's metadata make {weight} {module.out_features}x{module.in_features} (head "
                                    "count, sizes): a damaged or wrongly converted file")
            form = form_of(weight, module.in_features)
            if getattr(form, "type_name", None) == "Q4_0" and qkernels.loaded() and form.data.shape[0] % X8_ROWS == 0:
                form = q4_0_as_q4_1(form)  # the same weights, with Q4_1's interleaved tiles for wide passes
            if drafter_int4 and not is_four_bit(form) and module.in_features % INT4_GROUP == 0:
                form = requantize_q4_1(form) if qkernels.loaded() else requantize_int4(form)
            kernel = kernels.kernel(form, module.out_features, module.in_features)
            file_type = tensors[sources[weight]].tensor_type.name
            documented = kernels.override == "gguf8" and kernel == "gguf"  # --kernels gguf8: "else gguf"
            if kernels.override and kernel != kernels.override and not documented:
                instead[(file_type, kernel)] += 1
            elif kernel == "bf16" and file_type != "BF16" and not kernels.override:
                rounded[file_type] += 1
            state.update({f"{name}.{role}": t for role, t in linear_state(form, kernel).items()})
            if module.bias is not None:
                if f"{name}.bias" not in sources:
                    raise missing(f"{name}.bias")
                state[f"{name}.bias"] = form_of(f"{name}.bias").reshape(-1)
            layout[name] = {"kind": "linear", "kernel": kernel, "in": module.in_features,
                            "type": getattr(form, "type_name", None)}
    replaced = tuple(f"{name}." for name in layout)
    for name, param in model.named_parameters():
        if name.startswith(replaced):
            continue
        if name not in sources:
            raise missing(name)
        values = form_of(name)
        if not isinstance(values, torch.Tensor):
            raise NativeUnsupported(f"{name} is quantized in the file; only linear layers and embeddings may be")
        state[name] = values.reshape(param.shape).float()
        layout[name] = {"kind": "parameter"}
    for type_name, count in sorted(dequantized.items() if kernels.override not in ("bf16", "f32") else ()):
        # (under --kernels bf16 or f32 every layer runs dequantized, as asked: no note)
        why = "the integer kernels that read it are not built" if type_name in BLOCK_LAYOUT else \
            "no native kernel for that type"
        note(f"note: {counted(count, 'tensor')} of type {type_name} run dequantized ({why})")
    for (type_name, kernel), count in sorted(instead.items()):
        note(f"note: --kernels {kernels.override} cannot run {counted(count, 'layer')} of type {type_name}; "
             f"{'it runs' if count == 1 else 'they run'} on {kernel}")
    for type_name, count in sorted(rounded.items()):
        note(f"note: {counted(count, 'layer')} of type {type_name} run in bfloat16, measured fastest here (values "
             "rounded to it; --kernels f32 keeps them exact)")
    return config, layout, state


def counted(count: int, noun: str) -> str:
    return f"1 {noun}" if count == 1 else f"{count} {noun}s"


def build(config, layout: dict, state: dict[str, torch.Tensor], mapped: list[tuple[int, int]] = ()):
    """The model `prepare` described, from its tensors. Takes them out of `state` as it goes, so a tensor that
    a kernel repacks (bfloat16, float32) is freed before the next one is packed; where the tensors are mapped from
    the prepared folder's file (`mapped`: that file's mappings, `mapped_pages.file_ranges`), the pages such a
    tensor was read from are given back."""
    own = tree_applicable(config)
    model = NativeCausalLM(config) if own else empty_model(config)
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key in list(state):
        module_name, _, role = key.rpartition(".")
        by_module.setdefault(module_name, {})[role] = state.pop(key)
    for name, entry in layout.items():
        if entry["kind"] == "embedding":
            replace(model, name, GGUFEmbedding(entry["type"], by_module.pop(name)["weight"], entry["dim"]))
        elif entry["kind"] == "linear":
            roles = by_module.pop(name)
            bias = roles.pop("bias", None)
            layer = linear_from_state(entry["kernel"], roles, bias, entry["in"], entry.get("type"))
            if mapped:
                kept = [*layer.parameters(), *layer.buffers()]
                for source in roles.values():
                    mapped_pages.release(source, kept, mapped)
            replace(model, name, layer)
        else:
            owner_name, _, attr = name.rpartition(".")
            value = by_module[owner_name].pop(attr)
            setattr(model.get_submodule(owner_name), attr, torch.nn.Parameter(value, requires_grad=False))
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if leftover:
        raise NativeUnsupported(f"no weights for {leftover[0]}")
    if not own:
        use_rowwise_attention(model)  # batch-invariant logits: see utils/models/rowwise_attention.py
    return model.eval()


def is_four_bit(form) -> bool:
    """Small enough for a drafter as it is: 4-bit groups, or a type of at most ~4.5 bits a weight that our kernels
    read (re-quantising it to Q4_1, 5 bits, would make it larger and round it twice)."""
    return isinstance(form, Int4Groups) or getattr(form, "type_name", None) in (
        "Q4_K", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS",
        "IQ2_XXS", "IQ1_S", "IQ1_M")


def kernel_counts(model) -> Counter:
    """How many linear layers run on each kernel (our integer kernels named by the block type they read): the
    start-up line's summary."""
    names = {Int4Linear: "int4", Bf16Linear: "bf16", PackedLinear: "f32", torch.nn.Linear: "f32"}
    return Counter(m.label if type(m) is GGUFLinear else names[type(m)]
                   for m in model.modules() if type(m) in names or type(m) is GGUFLinear)


def replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    owner_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner_name) if owner_name else model, attr, new)

