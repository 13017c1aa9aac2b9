"""benchmarks/pass_overhead.py on a tiny attention shape: it runs, prints a figure for both paths and finds them
the same bits."""

from benchmarks import pass_overhead


def test_the_attention_table_runs_and_both_paths_agree(capsys):
    pass_overhead.main(["--skip-models", "--attention", "tiny-2x20"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.strip().startswith("tiny-2x20"))
    fast, plain = (float(x) for x in line.split(":")[1].split("same")[0].split("|"))
    assert fast > 0 and plain > 0 and line.endswith("same bits: True")
