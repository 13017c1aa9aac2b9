"""benchmarks/kernels.py and benchmarks/drafters.py, the float32 probes, on a tiny model: their contenders take
turns at each width (on 2 cores a slow spell of the host swings a figure 2x, and a contender timed after another
would carry it alone), every row of the table is filled, and swapping a kernel's layers in changes no result."""

import pytest
import torch

from benchmarks import drafters, kernels
from conftest import tiny_decoder
from cli_models import write_tiny_model
from utils.models.cpu_kernels import PackedLinear, packing_available
from utils.models.kernel_choice import WARMUP


def table_rows(out: str) -> dict[str, list[str]]:
    """{first cell: the other cells} of the markdown table rows in `out`, the header and rule left out."""
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_the_models_take_turns_at_each_width():
    model = tiny_decoder().cpu()  # the probes time CPU kernels, wherever the other tests run
    order = []
    costs = kernels.pass_costs({"a": model, "b": model}, repeats=2, ready=order.append)
    passes = order[2:]  # after each model's prefill
    per_width = 2 * (WARMUP + 2)
    assert len(passes) == per_width * len(kernels.WIDTHS)
    for start in range(0, len(passes), per_width):
        width_turns = passes[start : start + per_width]
        # in turns, every other turn reversed: a b | b a | a b | b a
        assert width_turns == ["a", "b", "b", "a"] * ((WARMUP + 2) // 2)
    assert set(costs) == {"a", "b"} and all(costs[m][w] > 0 for m in costs for w in kernels.WIDTHS)


def test_a_kernels_layers_swap_in_and_out_without_changing_the_logits():
    model = tiny_decoder().float().cpu()  # the probe's dtype and device: oneDNN packs float32 CPU weights
    x = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        before = model(input_ids=x).logits
    originals = [m for m in model.modules() if type(m) is torch.nn.Linear]
    makes = {"plain": None, "doubled": lambda linear: torch.nn.Sequential(linear, torch.nn.Identity())}
    if packing_available():
        makes["packed"] = PackedLinear
    layers = kernels.kernel_layers(model, makes)
    assert all(len(layers[label]) == len(originals) for label in makes)
    for label in makes:
        kernels.swap_in(layers[label])
        # the slots now hold that kernel's own layers (else the table would time torch's layers under its name)
        assert all(getattr(parent, name) is layer for parent, name, layer in layers[label])
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=x).logits, before, rtol=1e-4, atol=1e-5)
    assert all(type(layer) is torch.nn.Sequential for _, _, layer in layers["doubled"])
    kernels.swap_in(layers["plain"])  # the original layers themselves are back, not copies
    assert [m for m in model.modules() if type(m) is torch.nn.Linear] == originals


def test_the_kernel_table_has_a_figure_for_every_kernel_and_width(tmp_path, capsys):
    write_tiny_model(tmp_path)
    kernels.main(["--model", str(tmp_path), "--repeats", "1"])
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == ["MKL (torch default)", "oneDNN MkldnnLinear", "oneDNN PackedLinear"]
    for cells in rows.values():
        assert len(cells) == len(kernels.WIDTHS) and cells[0].endswith("(1.00x)")
        assert all(float(cell.split()[0]) >= 0 for cell in cells)


def test_the_drafter_table_has_every_variant_with_its_costs_and_agreement(monkeypatch, tmp_path, capsys):
    write_tiny_model(tmp_path)
    timed = []

    def costs(models, repeats):  # the real turns, then known figures: each column must show its own width's
        timed.append(kernels.pass_costs(models, repeats))
        return {label: {w: 10.0 * w + i for w in kernels.WIDTHS} for i, label in enumerate(models)}

    monkeypatch.setattr(drafters, "pass_costs", costs)
    drafters.main(["--target", str(tmp_path), "--drafter", str(tmp_path), "--prompts-per-group", "1",
                   "--max-new-tokens", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert list(rows) == list(drafters.VARIANTS) == list(timed[0])
    assert "(3 prompts in 3 groups, 4 tokens)" in out  # the first prompt of each group, no more
    assert [cells[:2] for cells in rows.values()] == [[f"{10 + i} ms", f"{90 + i} ms"] for i in range(len(rows))]
    # the float32 drafter is the target itself: it agrees with every one of the target's greedy tokens
    assert all(cell == "1.00" for cell in rows["float32"][2:])
    for cells in rows.values():
        assert cells[0].endswith(" ms") and cells[1].endswith(" ms") and len(cells) == 2 + 3


def test_a_widths_cost_is_the_median_of_its_timed_passes_in_ms_each_on_the_held_context(monkeypatch):
    """`pass_costs` on a fake clock: the untimed rounds' passes (a cold start) count in no figure, the figure is the
    median of the timed passes in milliseconds, and every pass sees the same 200 held positions (each one rolled
    back), not a context growing turn after turn."""
    from types import SimpleNamespace

    model = tiny_decoder().cpu()
    seconds = {"a": [1.0] * WARMUP + [0.004, 0.001, 0.002], "b": [1.0] * WARMUP + [0.008, 0.002, 0.004]}
    state = {"label": None, "passes": {"a": 0, "b": 0}, "start": None}

    def ready(label):
        state["label"] = label

    def perf_counter():  # the start of a pass, then its end: the seconds given for that label's pass at this width
        if state["start"] is None:
            state["start"] = 100.0
            return 100.0
        label, start = state["label"], state["start"]
        state["start"] = None
        n = state["passes"][label] % len(seconds[label])
        state["passes"][label] += 1
        return start + seconds[label][n]

    monkeypatch.setattr(kernels, "time", SimpleNamespace(perf_counter=perf_counter))
    held = []
    model.register_forward_pre_hook(lambda module, args, kwargs: held.append(kwargs["past_key_values"].get_seq_length()),
                                    with_kwargs=True)
    costs = kernels.pass_costs({"a": model, "b": model}, repeats=3, ready=ready)
    assert costs == {"a": {w: pytest.approx(2.0) for w in kernels.WIDTHS},
                     "b": {w: pytest.approx(4.0) for w in kernels.WIDTHS}}
    assert held[:2] == [0, 0] and set(held[2:]) == {kernels.CONTEXT}


def test_the_kernel_table_divides_each_width_by_the_one_token_pass(monkeypatch, tmp_path, capsys):
    """Each cell is a width's milliseconds and its cost over the one-token pass's (the price of verifying gamma
    tokens against generating them one by one)."""
    write_tiny_model(tmp_path)
    monkeypatch.setattr(kernels, "pass_costs", lambda models, repeats, ready: {
        label: {w: 10.0 * w * (i + 1) for w in kernels.WIDTHS} for i, label in enumerate(models)})
    kernels.main(["--model", str(tmp_path), "--repeats", "1"])
    rows = table_rows(capsys.readouterr().out)
    assert rows["oneDNN MkldnnLinear"][:3] == ["20 (1.00x)", "40 (2.00x)", "60 (3.00x)"]
