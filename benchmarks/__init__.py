"""Benchmarks of our generators against transformers' own `generate()` on the embedded default pair."""
