"""The chat application behind `infer.py`: settings, the slash-command table and the session that runs the
generators. The top layer: it may import `sampling`, `ngram_assisted` and the rest of `utils`."""
