"""benchmarks/ngram_prior.py on the tiny chat model: `build` writes a prior that records where it came from, and
`measure` runs NASD with and without it (or against another build) and finds the same tokens in every row."""

import hashlib

import pytest

from benchmarks import ngram_prior as bench
from cli_models import write_tiny_model
from ngram_assisted import ngram_prior
from ngram_assisted.ngram_cache import read_state


def test_build_then_measure_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    write_tiny_model(tmp_path / "model")
    monkeypatch.setattr(ngram_prior, "PRIORS", tmp_path / "priors")
    monkeypatch.setattr(bench, "ANSWER_TOKENS", 6)
    bench.main(["build", "--target", str(tmp_path / "model")])
    (path,) = (tmp_path / "priors").glob("*.json.gz")
    about = read_state(path)["about"]
    assert about["prompts_sha256"] == hashlib.sha256(bench.PRIOR_PROMPTS.read_bytes()).hexdigest()
    assert 0 < about["answer_tokens"] <= 6 * sum(len(p) for p in bench.prompts_of(bench.PRIOR_PROMPTS).values())
    capsys.readouterr()
    bench.main(["measure", "--target", str(tmp_path / "model"), "--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| o")]
    assert len(rows) == 6 and all(row.endswith("| yes |") for row in rows), rows
    for row in rows:  # the tiny model's answers are in its prior: fewer passes with it
        without, with_prior = (int(cell.split(" passes")[0].split()[-1]) for cell in row.split("|")[3:5])
        assert with_prior < without, row
    capsys.readouterr()
    bench.main(["measure", "--target", str(tmp_path / "model"), "--repeats", "1", "--against", str(path)])
    out = capsys.readouterr().out
    assert f"| against {path.name} | with the prior |" in out
    rows = [line for line in out.splitlines() if line.startswith("| o")]
    assert len(rows) == 6 and all(row.endswith("| yes |") for row in rows), rows
    for row in rows:  # the same build on both sides: the same passes
        against, with_prior = (int(cell.split(" passes")[0].split()[-1]) for cell in row.split("|")[3:5])
        assert against == with_prior, row
    (tmp_path / "damaged.json.gz").write_bytes(b"not gzip")
    with pytest.raises(SystemExit, match="python -m benchmarks.ngram_prior: .*damaged.json.gz"):
        bench.main(["measure", "--target", str(tmp_path / "model"), "--against", str(tmp_path / "damaged.json.gz")])
