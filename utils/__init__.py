"""The shared generation core: KV-cache rollback (`caching`), the model runner, logits processors, printing.
Its top-level modules import torch and transformers only, never a generator; `chat/` and `models/` sit beside it."""
