"""benchmarks/kernels.py and benchmarks/drafters.py, the float32 probes, on a tiny model: their contenders take
turns at each width (on 2 cores a slow spell of the host swings a figure 2x, and a contender timed after another
would carry it alone), every row of the table is filled, and swapping a kernel's layers in changes no result."""

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
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=x).logits, before, rtol=1e-4, atol=1e-5)
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


def test_the_drafter_table_has_every_variant_with_its_costs_and_agreement(tmp_path, capsys):
    write_tiny_model(tmp_path)
    drafters.main(["--target", str(tmp_path), "--drafter", str(tmp_path), "--prompts-per-group", "1",
                   "--max-new-tokens", "4", "--repeats", "1"])
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == list(drafters.VARIANTS)
    # the float32 drafter is the target itself: it agrees with every one of the target's greedy tokens
    assert all(cell == "1.00" for cell in rows["float32"][2:])
    for cells in rows.values():
        assert cells[0].endswith(" ms") and cells[1].endswith(" ms") and len(cells) == 2 + 3
