"""Shared pieces: logits processors, the KV-cache core, model loading and printing."""
