"""GGUF files on the Hugging Face hub (`owner/repo:QUANT`, `owner/repo/FILE.gguf`), read here from a local Hugging
Face cache laid out as the hub's client lays it out (offline), and the online path with the hub's client
replaced (what it is asked to download)."""

import shutil
from pathlib import Path

import pytest
import torch

from gguf_models import write_tiny_gguf
from utils.models.gguf_header import named_parts
from utils.models.hub_gguf import hub_gguf_path
from utils.models.model_loader import ModelLoadError, gguf_file, load_model, parse_spec

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hubfiles")
    return {
        "whole": write_tiny_gguf(folder / "tiny-q4_k_m.gguf", seed=7, tokenizer=True),
        "split": write_tiny_gguf(folder / "tiny-Q8_0.gguf", seed=7, tokenizer=True, split_tensors=12),
        "other": write_tiny_gguf(folder / "tiny-f32.gguf", seed=8, tokenizer=True),
    }


def cached_repo(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """A repository in the Hugging Face cache as the hub's client leaves it: refs/main naming a snapshot folder
    that holds the files under their repository paths."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(REVISION)
    snapshot = root / "snapshots" / REVISION
    for name, source in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, snapshot / name)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch, files):
    from huggingface_hub import constants

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "specdec"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no local folder named like an owner
    split = {p.name: p for p in named_parts(files["split"])}
    snapshot = cached_repo(tmp_path / "hf", "someone/Tiny-GGUF", {
        "tiny-q4_k_m.gguf": files["whole"], "tiny-f32.gguf": files["other"], **{f"q8/{n}": p for n, p in split.items()},
    })
    return snapshot


def test_specs_of_hub_files_are_told_from_local_paths_and_model_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_spec("someone/Tiny-GGUF:Q4_K_M").kind == "hub-gguf"
    assert parse_spec("someone/Tiny-GGUF/sub/tiny-q4_k_m.gguf").kind == "hub-gguf"
    assert parse_spec("someone/Tiny").kind == "hub"
    (tmp_path / "models").mkdir()  # a mistyped local path stays one
    with pytest.raises(ModelLoadError, match="no GGUF file at"):
        parse_spec("models/qwen/model.gguf")
    with pytest.raises(ModelLoadError, match="no GGUF file at"):
        parse_spec("./someone/Tiny-GGUF/model.gguf")


def test_a_quantisation_picks_the_file_and_runs_it_as_the_local_file(hub, files):
    model, _ = load_model("someone/Tiny-GGUF:Q4_K_M", device="cpu", progress=False)  # any case
    local, _ = load_model(str(files["whole"]), device="cpu", progress=False)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, local(ids).logits)
    assert gguf_file("someone/Tiny-GGUF:q4_k_m") == hub / "tiny-q4_k_m.gguf"
    assert gguf_file("someone/Tiny-GGUF/tiny-f32.gguf") == hub / "tiny-f32.gguf"


def test_a_repository_of_gguf_files_named_alone_runs_its_q4_k_m_file(hub, files, capsys):
    """As llama.cpp's `-hf` does; where it has none, one line naming what it has."""
    model, _ = load_model("someone/Tiny-GGUF", device="cpu")
    local, _ = load_model(str(files["whole"]), device="cpu", progress=False)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, local(ids).logits)
    assert "someone/Tiny-GGUF: a repository of GGUF files; running its Q4_K_M file" in capsys.readouterr().err
    (hub / "tiny-q4_k_m.gguf").unlink()
    with pytest.raises(ModelLoadError, match="no GGUF file with 'Q4_K_M' in its name .*; it has: .*tiny-f32.gguf "
                                             "\\(name one: someone/Tiny-GGUF:QUANT or someone/Tiny-GGUF/FILE.gguf\\)"):
        load_model("someone/Tiny-GGUF", device="cpu", dtype="float32", progress=False)
    with pytest.raises(ModelLoadError, match="the local Hugging Face cache does not hold it"):  # not a GGUF repository
        load_model("someone/Other-GGUF", device="cpu", progress=False)


def test_a_split_model_on_the_hub_is_found_by_its_first_part(hub, files):
    assert gguf_file("someone/Tiny-GGUF:Q8_0") == hub / "q8" / "tiny-Q8_0-00001-of-00003.gguf"
    model, _ = load_model("someone/Tiny-GGUF/q8/tiny-Q8_0-00001-of-00003.gguf", device="cpu", progress=False)
    local, _ = load_model(str(files["split"]), device="cpu", progress=False)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, local(ids).logits)


def test_no_or_several_matching_files_and_an_uncached_repo_are_one_line(hub, tmp_path):
    with pytest.raises(ModelLoadError, match="no GGUF file with 'Q5_K_M' in its name in the local Hugging Face "
                                             "cache \\(offline\\); it has: q8/tiny-Q8_0-00001-of-00003.gguf, "
                                             "tiny-f32.gguf, tiny-q4_k_m.gguf"):
        gguf_file("someone/Tiny-GGUF:Q5_K_M")
    with pytest.raises(ModelLoadError, match="3 GGUF files have 'tiny' in their names .*; name one as "
                                             "someone/Tiny-GGUF/FILE.gguf"):
        gguf_file("someone/Tiny-GGUF:tiny")
    for spec in ("someone/Other-GGUF:Q4_K_M", "someone/Other-GGUF/absent.gguf"):
        with pytest.raises(ModelLoadError, match="the Hugging Face hub cannot be reached \\(or HF_HUB_OFFLINE is "
                                                 "set\\) and the local Hugging Face cache does not hold it"):
            load_model(spec, device="cpu", progress=False)
    with pytest.raises(ModelLoadError, match="someone/Tiny-GGUF in the local Hugging Face cache \\(offline\\) has no "
                                             "file absent.gguf; it has: q8/tiny-Q8_0-00001-of-00003.gguf, "
                                             "tiny-f32.gguf, tiny-q4_k_m.gguf$"):
        load_model("someone/Tiny-GGUF/absent.gguf", device="cpu", progress=False)
    (hub / "q8" / "tiny-Q8_0-00002-of-00003.gguf").unlink()  # a part the cache lacks
    with pytest.raises(ModelLoadError, match="in the local Hugging Face cache \\(offline\\) has no file q8/tiny-Q8_0-00002-of-00003.gguf"):
        gguf_file("someone/Tiny-GGUF:Q8_0")


def test_online_the_hub_lists_the_repository_and_every_part_is_downloaded(hub, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError

    from utils.models import model_loader

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_loader, "hub_reachable", lambda: True)
    listed = ["README.md", "tiny-q4_k_m.gguf", "tiny-f32.gguf",
              *(f"q8/tiny-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3))]
    asked = []

    class Api:
        def list_repo_files(self, repo):
            if repo != "someone/Tiny-GGUF":
                raise http_error(RepositoryNotFoundError, "404 Client Error")
            return listed

    def download(repo, file, revision=None, local_files_only=False):
        asked.append((repo, file, revision, local_files_only))
        return str(hub / file)

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert gguf_file("someone/Tiny-GGUF:q8_0") == hub / "q8" / "tiny-Q8_0-00001-of-00003.gguf"
    # the parts after the first come from the commit the first part's snapshot folder is named after
    assert asked == [("someone/Tiny-GGUF", f"q8/tiny-Q8_0-0000{i}-of-00003.gguf", None if i == 1 else REVISION,
                      False) for i in (1, 2, 3)]
    with pytest.raises(ModelLoadError, match="no repository someone/Nothing on the Hugging Face hub"):
        gguf_file("someone/Nothing:Q4_K_M")

    class Silent:
        def list_repo_files(self, repo):
            raise ConnectionError("the hub's port is blocked")

    monkeypatch.setattr(huggingface_hub, "HfApi", Silent)  # online, no answer: the cached repository's files
    asked.clear()
    assert gguf_file("someone/Tiny-GGUF:Q4_K_M") == hub / "tiny-q4_k_m.gguf"
    with pytest.raises(ModelLoadError, match="cannot download someone/Other-GGUF: ConnectionError: the hub's port"):
        gguf_file("someone/Other-GGUF:Q4_K_M")


def test_a_model_too_large_to_prepare_is_refused_before_its_download(hub, monkeypatch):
    """The hub's sizes of every part, against the free memory a preparation needs: refused without a byte
    downloaded; a file the Hugging Face cache holds is not asked about (the loader checks it)."""
    import huggingface_hub
    from types import SimpleNamespace

    from utils.models import memory_check

    sizes = {"big-Q8_0-00001-of-00002.gguf": 900_000_000, "big-Q8_0-00002-of-00002.gguf": 700_000_000}
    asked, downloaded = [], []

    class Api:
        def get_paths_info(self, repo, paths):
            asked.append(paths)
            return [SimpleNamespace(path=p, size=sizes[p]) for p in paths]

    def download(repo, file, revision=None, local_files_only=False):
        downloaded.append(file)
        return str(hub / file)

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 1_000_000_000)
    with pytest.raises(ModelLoadError, match=r"^someone/Tiny-GGUF/big-Q8_0-00001-of-00002.gguf: preparing it holds "
                                             r"its 1.6 GB of blocks in memory, more than this machine has free "
                                             r"\(1.0 GB of memory and swap\)"):
        hub_gguf_path("someone/Tiny-GGUF/big-Q8_0-00001-of-00002.gguf", online=True)
    assert asked == [list(sizes)] and downloaded == []
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 2_000_000_000)  # room: downloaded
    hub_gguf_path("someone/Tiny-GGUF/big-Q8_0-00001-of-00002.gguf", online=True)
    assert downloaded == ["big-Q8_0-00001-of-00002.gguf"]
    asked.clear()
    monkeypatch.setattr(memory_check, "free_bytes", lambda: 1)  # cached: the loader's own check, after
    assert hub_gguf_path("someone/Tiny-GGUF/tiny-f32.gguf", online=True) == hub / "tiny-f32.gguf"
    assert asked == []


def test_a_quantisation_is_a_whole_tag_and_projectors_are_no_models(hub, files):
    """`F16` is not `BF16`; a vision projector (`mmproj-…`) is left out; a snapshot the client knows to be partial
    (one quantisation downloaded, its tree listing saved) still answers."""
    for name in ("tiny-BF16.gguf", "mmproj-tiny-F16.gguf", "tiny-F16.gguf"):
        shutil.copy(files["other"], hub / name)
    from huggingface_hub import snapshot_download
    from huggingface_hub._snapshot_download import TreeCacheEntry, write_tree_cache
    from huggingface_hub.errors import IncompleteSnapshotError

    # the listing the client saves with a download, naming a quantisation this cache does not hold
    listed = [p.relative_to(hub).as_posix() for p in hub.rglob("*.gguf")] + ["tiny-Q3_K_M.gguf"]
    write_tree_cache(str(hub.parents[1]), REVISION, {f: TreeCacheEntry(size=1, blob_id=f"b{i}")
                                                     for i, f in enumerate(listed)})
    with pytest.raises(IncompleteSnapshotError):  # the client's own listing of the cache refuses it
        snapshot_download("someone/Tiny-GGUF", local_files_only=True, allow_patterns=["*.gguf"])
    assert gguf_file("someone/Tiny-GGUF:f16") == hub / "tiny-F16.gguf"
    assert gguf_file("someone/Tiny-GGUF:BF16") == hub / "tiny-BF16.gguf"
    with pytest.raises(ModelLoadError, match="no GGUF file with 'F3'"):  # a tag ends where its name's part does
        gguf_file("someone/Tiny-GGUF:F3")  # (not within tiny-f32)
    shutil.copy(files["other"], hub / "TINY-Q6_K.GGUF")  # the extension in any case, as the file names one
    assert gguf_file("someone/Tiny-GGUF:Q6_K") == hub / "TINY-Q6_K.GGUF"
    for name in ("tiny-Q4_0_4_4.gguf", "tiny-Q4_0.gguf", "tiny-Q4_0_8_8.gguf", "tiny-Q4_K_S.gguf"):
        shutil.copy(files["other"], hub / name)
    assert gguf_file("someone/Tiny-GGUF:Q4_0") == hub / "tiny-Q4_0.gguf"  # its repacked variants are not meant
    with pytest.raises(ModelLoadError, match=r"2 GGUF files have 'Q4_K' .*tiny-Q4_K_S.gguf, tiny-q4_k_m.gguf"):
        gguf_file("someone/Tiny-GGUF:Q4_K")  # none is Q4_K itself: the user chooses


def test_the_chat_answers_with_a_hub_file_and_says_a_missing_one_in_one_line(hub, tmp_path):
    """`python infer.py --target owner/repo:QUANT` offline, from the Hugging Face cache; greedy SD equals the
    target there as everywhere."""
    import json
    import subprocess
    import sys

    from test_cli import ROOT, env

    def chat(target, drafter):
        argv = [sys.executable, "infer.py", "--target", target, "--drafter", drafter, "--device", "cpu",
                "--prompt", "hello", "--length", "6", "--json", "--generators", "target,speculative"]
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=env(HF_HUB_CACHE=str(tmp_path / "hf"), SPECDEC_CACHE_DIR=str(tmp_path / "specdec")))

    done = chat("someone/Tiny-GGUF:Q8_0", "someone/Tiny-GGUF/tiny-q4_k_m.gguf")
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(reports) == 2 and reports[0]["token_ids"] == reports[1]["token_ids"] and reports[0]["token_ids"]
    done = chat("someone/Tiny-GGUF:Q2_K", "someone/Tiny-GGUF:Q8_0")
    assert done.returncode == 1 and "no GGUF file with 'Q2_K' in its name" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("spec", ["someone/Tiny-GGUF/", "someone/Tiny-GGUF@main", "someone/Tiny-GGUF@main:Q4_K_M",
                                  "someone/Tiny-GGUF:Q8_0/", "-x/y:Q4_K_M", "a/b--c:Q4_K_M", "a/b--c/x.gguf"])
def test_ids_the_hubs_client_refuses_are_one_line(hub, spec):
    with pytest.raises(ModelLoadError) as error:
        load_model(spec, device="cpu", progress=False)
    assert "\n" not in str(error.value) and len(str(error.value)) < 400


def test_a_snapshots_linked_parts_are_found_beside_the_path_given(hub, tmp_path):
    """The client keeps each file once, as a blob named by its hash, and links the snapshot's names to it: a split
    model's first part given by its path in the cache finds the other parts by their names there."""
    blobs = hub.parents[1] / "blobs"
    blobs.mkdir()
    for part in named_parts(hub / "q8" / "tiny-Q8_0-00001-of-00003.gguf"):
        blob = blobs / f"{abs(hash(part.name)):x}"
        part.rename(blob)
        part.symlink_to(blob)
    model, _ = load_model(str(hub / "q8" / "tiny-Q8_0-00001-of-00003.gguf"), device="cpu", progress=False)
    assert not model.config.tie_word_embeddings  # the head in a later part was found


def test_the_benchmarks_gguf_of_a_repository_named_alone_and_a_missing_file_in_a_cached_one(hub):
    assert gguf_file("someone/Tiny-GGUF") == hub / "tiny-q4_k_m.gguf"
    with pytest.raises(ModelLoadError, match="someone/Tiny-GGUF in the local Hugging Face cache \\(offline\\) has no "
                                             "file tiny-Q4_K_M.GGUF; it has: q8/tiny-Q8_0-00001-of-00003.gguf"):
        gguf_file("someone/Tiny-GGUF/tiny-Q4_K_M.GGUF")


def test_a_split_model_of_two_parts_downloads_its_second_part(hub, tmp_path, monkeypatch):
    """Two parts is the smallest split: its second part comes with the first, from the first's commit."""
    import huggingface_hub
    from huggingface_hub import constants

    from utils.models import model_loader

    parts = named_parts(write_tiny_gguf(tmp_path / "tiny-Q6_K.gguf", seed=7, tokenizer=True,
                                        split_tensors=20))
    assert len(parts) == 2  # the premise: a split into two files
    for part in parts:
        shutil.copy(part, hub / part.name)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_loader, "hub_reachable", lambda: True)
    asked = []

    class Api:
        def list_repo_files(self, repo):
            return [part.name for part in parts]

    def download(repo, file, revision=None, local_files_only=False):
        asked.append((file, revision))
        return str(hub / file)

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert gguf_file("someone/Tiny-GGUF:Q6_K") == hub / parts[0].name
    assert asked == [(parts[0].name, None), (parts[1].name, REVISION)]


def test_a_repository_the_hub_says_is_missing_is_not_read_from_the_cache(hub, monkeypatch):
    """A 404 (deleted, private, gated) is the hub's answer, not a hub out of reach: the cached copy of the
    repository's listing does not stand in for it."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError

    from utils.models import model_loader

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_loader, "hub_reachable", lambda: True)

    class Api:
        def list_repo_files(self, repo):
            raise http_error(RepositoryNotFoundError, "404 Client Error")

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    with pytest.raises(ModelLoadError, match="^no repository someone/Tiny-GGUF on the Hugging Face hub"):
        gguf_file("someone/Tiny-GGUF:Q4_K_M")


def http_error(cls, message):
    """One of the hub's HTTP errors, made without the response its __init__ wants."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


def wrapped_uncached():
    """A missing cache entry as transformers reports it: an OSError raised while handling the hub's error."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        try:
            raise LocalEntryNotFoundError("not in the cache")
        except LocalEntryNotFoundError:
            raise OSError("We couldn't connect to the hub")
    except OSError as error:
        return error


@pytest.mark.parametrize("online", [True, False])
def test_each_answer_of_the_hub_is_said_as_what_it_is(hub, online):
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HFValidationError

    from utils.models.hub_gguf import UNCACHED, hub_error

    def said(error, repo="someone/Tiny-GGUF", file="x.gguf"):
        return str(hub_error(error, repo, file, online))

    verb = "download" if online else "read"
    assert said(http_error(GatedRepoError, "403")).startswith("someone/Tiny-GGUF is gated: accept its terms")
    assert said(http_error(EntryNotFoundError, "404")) == "someone/Tiny-GGUF has no file x.gguf"
    # the OS's reason alone, not Python's "[Errno 28] …"
    assert said(OSError(28, "No space left on device")) == f"cannot {verb} someone/Tiny-GGUF/x.gguf: No space left " \
                                                          "on device"
    invalid = said(HFValidationError("Repo id must use alphanumeric chars, '-', '_' or '.'. The name cannot start or "
                                     "end with '-' or '.' and the maximum length is 96: '-x/y'."), repo="-x/y")
    # the client's first sentence is the reason; the rest of its paragraph would crowd the one line
    assert invalid.startswith("'-x/y' is no Hugging Face id (Repo id must use alphanumeric chars, '-', '_' or '.')")
    assert "maximum length" not in invalid
    # the missing entry is found behind transformers' wrapping, and the file asked for is named
    assert said(wrapped_uncached(), repo="someone/Other-GGUF") == \
        f"cannot load model 'someone/Other-GGUF/x.gguf': {UNCACHED}"
    # a cached repository lacking the file: its files are listed offline only (online, the hub was not reached)
    expected = ("someone/Tiny-GGUF in the local Hugging Face cache (offline) has no file x.gguf" if not online else
                f"cannot load model 'someone/Tiny-GGUF/x.gguf': {UNCACHED}")
    assert said(wrapped_uncached()).startswith(expected)


def test_a_long_list_of_files_is_cut_at_eight_and_says_how_many_more():
    from utils.models.hub_gguf import listed

    eight = [f"m-{i}.gguf" for i in range(8)]
    assert listed(eight) == ", ".join(eight)  # all shown: no "and 0 more"
    assert listed(eight + ["m-8.gguf"]) == ", ".join(eight) + " and 1 more"


def test_a_repository_named_in_lower_case_gguf_runs_its_q4_k_m_file(hub, tmp_path, files):
    snapshot = cached_repo(tmp_path / "hf", "someone/tiny-gguf", {"tiny-q4_k_m.gguf": files["whole"]})
    assert gguf_file("someone/tiny-gguf") == snapshot / "tiny-q4_k_m.gguf"


def test_a_cached_repository_is_one_of_gguf_files_only_without_a_config(hub, tmp_path, files):
    """A transformers repository that also ships a GGUF file loads as a transformers model: its failure is its
    own, not "a repository of GGUF files"."""
    from utils.models.hub_gguf import gguf_repository

    cached_repo(tmp_path / "hf", "someone/Both", {"config.json": files["other"], "m-q4_k_m.gguf": files["whole"]})
    cached_repo(tmp_path / "hf", "someone/Only", {"m-q4_k_m.gguf": files["whole"]})
    failure = OSError("some other failure")
    assert not gguf_repository("someone/Both", failure) and gguf_repository("someone/Only", failure)
