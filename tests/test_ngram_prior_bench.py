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


def test_build_counts_each_answer_after_its_lead_tokens_alone(tmp_path, monkeypatch, capsys):
    """The prior learns how answers begin from the LEAD template tokens before each answer, never from the prompt's
    text (the held-out prompts' words must not be what the prior foresees), and records the answer tokens it
    counted (never the prompt's); the prompt file's `_` groups are notes, not prompts."""
    import json
    from types import SimpleNamespace

    from ngram_assisted import NGramStorage

    prompts = tmp_path / "prior_prompts.json"
    prompts.write_text(json.dumps({"_note": ["not a prompt"], "g": ["p1", "p2"]}))
    saved = []
    monkeypatch.setattr(bench, "PRIOR_PROMPTS", prompts)
    monkeypatch.setattr(bench, "load_model", lambda name: (SimpleNamespace(config=SimpleNamespace(vocab_size=64)), None))
    monkeypatch.setattr(bench, "stop_tokens", lambda *args, **kwargs: [1])
    monkeypatch.setattr(bench, "chat_ids", lambda tokenizer, prompt: [40, 41, 42, 43, 44, 45])
    answered = []
    monkeypatch.setattr(bench, "autoregressive_run",
                        lambda ids, *args, **kwargs: answered.append(ids) or SimpleNamespace(tokens=[7, 8, 9]))
    monkeypatch.setattr(bench, "commit", lambda: "c")
    monkeypatch.setattr(bench, "machine", lambda: "m")
    monkeypatch.setattr(bench, "prior_fingerprint", lambda tokenizer: "fp")
    monkeypatch.setattr(bench, "prior_path", lambda fingerprint: tmp_path / "priors" / f"{fingerprint}.json.gz")
    monkeypatch.setattr(bench, "save_storage",
                        lambda path, storage, fingerprint, about: saved.append((storage, about)) or path.write_text(""))
    bench.main(["build"])
    assert len(answered) == 2  # the two prompts of "g"
    (storage, about), = saved
    expected = NGramStorage(bench.PRIOR_N, 64)
    for _ in range(2):
        expected.add_sequence([43, 44, 45, 7, 8, 9])  # LEAD (3) template tokens, then the answer
    assert storage.counts == expected.counts
    assert about["answer_tokens"] == 6


def test_measure_alternates_counts_the_first_repeat_and_compares_every_prompt(tmp_path, monkeypatch, capsys):
    """measure's table, on stand-ins for the model and NASD: with and without the prior take turns going first
    (prompt by prompt and repeat by repeat), passes and drafts are those of the first repeat, seconds the median
    over repeats, the time ratio is with over without, the cache off runs at the chat's 35 tokens and on at 128,
    and one prompt whose outputs differ marks the row, whatever the prompts after it; three repeats by default."""
    import json
    from types import SimpleNamespace

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"g": ["aa", "bbb"]}))
    clock, calls = [0.0], []

    def nasd(ids, storage, target, processor, loop, top_k, use_cache, prior=None):
        with_prior = prior is not None
        if ids != [5]:  # the warm-up runs ("Hello") are left out of the figures
            calls.append((ids[0], use_cache, loop.max_gen_len, with_prior))
            clock[0] += 1.0 if with_prior else 2.0
        differ = with_prior and ids == [2] and not use_cache  # the first prompt's outputs differ, cache off
        return SimpleNamespace(tokens=[9] if differ else [8], target_calls=3 if with_prior else 5,
                               accepted=4 if with_prior else 2, drafted=8)

    monkeypatch.setattr(bench, "PROMPTS", prompts)
    monkeypatch.setattr(bench, "load_model", lambda name: (SimpleNamespace(config=SimpleNamespace(vocab_size=64)), None))
    monkeypatch.setattr(bench, "stop_tokens", lambda *args, **kwargs: [1])
    monkeypatch.setattr(bench, "prior_fingerprint", lambda tokenizer: "fp")
    monkeypatch.setattr(bench, "shipped_prior", lambda fingerprint, vocab: "the prior")
    monkeypatch.setattr(bench, "machine", lambda: "m")
    monkeypatch.setattr(bench, "chat_ids", lambda tokenizer, prompt: [len(prompt)])
    monkeypatch.setattr(bench, "nasd_run", nasd)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    bench.main(["measure", "--repeats", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| o")]
    assert rows == ["| off, 35 | g | 4.00 s, 10 passes, 4/16 | 2.00 s, 6 passes, 8/16 | 0.500 | NO |",
                    "| on, 128 | g | 4.00 s, 10 passes, 4/16 | 2.00 s, 6 passes, 8/16 | 0.500 | yes |"]
    order = [(ids, with_prior) for ids, use_cache, length, with_prior in calls if not use_cache]
    assert order == [(2, False), (2, True), (3, True), (3, False), (2, True), (2, False), (3, False), (3, True)]
    assert {(use_cache, length) for _, use_cache, length, _ in calls} == {(False, 35), (True, 128)}
    calls.clear()
    bench.main(["measure"])
    assert "--repeats 3" in capsys.readouterr().out and len(calls) == 3 * 2 * 2 * 2
