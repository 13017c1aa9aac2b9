"""Whether a model's weights can fit in this machine's free memory, asked before they are read.

A model past the memory (a user's 8B in float32 on a 16 GB laptop: 32 GB) loads for minutes, its download
included, until the kernel kills the process: the shell's "Killed", no word of ours. Its weights' bytes are known
from the config alone (the parameters of a model built on the meta device, times the dtype's size), so a load that
cannot fit is refused first, in one line. The weights are a lower bound of what a load holds (float32's oneDNN
packing copies the linear layers again), so nothing that could fit is refused. A native GGUF model runs from
blocks mapped from its prepared file, pages the kernel may drop and read again; its preparation, though, holds
all the file's blocks in memory at once, and is asked the same of the file's size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from utils.models.load_error import ModelLoadError

def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes; {} where there is none (not Linux)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        name, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            values[name] = int(words[0]) * (1024 if words[1:] == ["kB"] else 1)
    return values


CGROUP_ROOT = Path("/sys/fs/cgroup")
# (limit, usage, the page cache in memory.stat): cgroup v2's files, then v1's, under its memory controller's folder
CGROUP_V2 = ("memory.max", "memory.current", "file")
CGROUP_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")


def cgroup_folders() -> list[Path]:
    """The memory cgroup folders of this process, its own first, then up to the mount's root: a container's
    limit is not in /proc/meminfo, which shows the host's memory."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's one hierarchy
            base = CGROUP_ROOT
        elif "memory" in controllers.split(","):
            base = CGROUP_ROOT / "memory"
        else:
            continue
        own = base / path.lstrip("/")
        folders += [own, *[p for p in own.parents if base in (p, *p.parents)]]
    return folders


def cgroup_room() -> int | None:
    """What this process's memory cgroups let it add, page cache counted as free (the kernel reclaims it, as
    MemAvailable counts it); None where none sets a limit."""
    rooms = []
    for folder in cgroup_folders():
        for limit_name, usage_name, cache_name in (CGROUP_V2, CGROUP_V1):
            try:
                limit, usage = (folder / limit_name).read_text().strip(), (folder / usage_name).read_text().strip()
                stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
            except (OSError, ValueError):
                continue
            if limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:  # "max", or v1's near 2**63: none
                rooms.append(max(int(limit) - int(usage) + int(stat.get(cache_name, 0)), 0))
    return min(rooms) if rooms else None


def free_bytes() -> int | None:
    """Memory a load may still take: what the kernel counts available (within a cgroup's limit), plus free swap.
    None where this cannot be told (not Linux)."""
    info = meminfo()
    if "MemAvailable" not in info:
        return None
    room = cgroup_room()
    memory = info["MemAvailable"] if room is None else min(info["MemAvailable"], room)
    return memory + info.get("SwapFree", 0)


def weight_bytes(config, dtype: torch.dtype) -> int | None:
    """The bytes of the weights of the causal LM `config` describes, in `dtype` (tied ones once); None where
    transformers cannot build it from its config alone (remote code, say), or where its checkpoint is quantized
    (GPTQ, AWQ, bitsandbytes: the meta model's full-precision layers would count several times its bytes)."""
    from transformers import AutoModelForCausalLM

    if getattr(config, "quantization_config", None) is not None:
        return None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # whatever cannot be built here is loaded, and judged, as before
        return None
    return model.num_parameters() * dtype.itemsize


Q4_K_M_BITS = 4.85  # bits per weight of a Q4_K_M GGUF file (llama.cpp's figure for 7-8B models)


def check_memory(spec: str, config, dtype: torch.dtype, cpu: bool, gguf: bool) -> None:
    """ModelLoadError where the weights alone, in `dtype`, exceed what this machine has free, naming a form of the
    model that fits, if any: its blocks at their own precision where it is a GGUF file (`gguf`) on the CPU
    (`cpu`), bfloat16, a Q4_K_M GGUF file on the CPU."""
    free = free_bytes()
    if free is None:
        return
    need = weight_bytes(config, dtype)
    if need is None or need <= free:
        return
    params = need // dtype.itemsize
    q4 = params * Q4_K_M_BITS / 8
    if gguf and cpu:
        advice = "; --dtype auto runs its GGUF blocks at their own precision"
    elif dtype == torch.float32 and params * 2 <= free:
        advice = f"; --dtype bfloat16 takes {params * 2 / 1e9:.1f} GB"
    elif cpu and q4 <= free:
        advice = f"; a Q4_K_M GGUF file of it takes about {q4 / 1e9:.1f} GB, run at its own precision"
    elif cpu:
        advice = f"; even a Q4_K_M GGUF file of it would take about {q4 / 1e9:.1f} GB"
    else:
        advice = ""
    from utils.models.model_loader import dtype_name  # here: model_loader imports this module

    raise ModelLoadError(f"{spec}: its weights take {need / 1e9:.1f} GB in {dtype_name(dtype)}, "
                         f"more than this machine has free ({free / 1e9:.1f} GB of memory and swap){advice}")


def check_preparation(path: Path, parts: list[Path]) -> None:
    """ModelLoadError where preparing the GGUF model `path` (in `parts`) would hold more than this machine has free:
    the file's blocks, copied off its mapping."""
    check_blocks_fit(str(path), sum(part.stat().st_size for part in parts))


def check_blocks_fit(name: str, size: int) -> None:
    """ModelLoadError where a GGUF model of `size` bytes (all its parts) cannot be prepared in the free memory;
    asked before a hub file's download too."""
    free = free_bytes()
    if free is not None and size > free:
        raise ModelLoadError(f"{name}: preparing it holds its {size / 1e9:.1f} GB of blocks in memory, more than this "
                             f"machine has free ({free / 1e9:.1f} GB of memory and swap); a smaller quantisation of "
                             "the model takes less")
