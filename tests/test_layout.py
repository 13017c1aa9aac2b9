"""The layering the packages' docstrings promise: the shared core imports no generator, the model side no chat."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_core_imports_no_generator_and_no_chat():
    loaded = imported_after("import utils.caching, utils.model_runner, utils.logits_processor, utils.printing")
    assert not {m for m in loaded if m.split(".")[0] in ("sampling", "ngram_assisted")}
    assert not {m for m in loaded if m.startswith(("utils.chat", "utils.models"))}


def test_model_loading_imports_no_generator_and_no_chat():
    loaded = imported_after("import utils.models.model_loader, utils.models.gguf_native")
    assert not {m for m in loaded if m.split(".")[0] in ("sampling", "ngram_assisted") or m.startswith("utils.chat")}


def test_the_documented_loader_import_still_works():
    from utils.model_loader import ModelLoadError, load_model
    from utils.models import model_loader

    assert load_model is model_loader.load_model and ModelLoadError is model_loader.ModelLoadError
