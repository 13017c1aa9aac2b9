"""Tiny GGUF files the tests write: random but valid blocks of every type the embedded files use, laid out as
llama.cpp lays out a Qwen2 or Llama model (a few hundred kB, no download)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2  # K-quant blocks need rows of 256
HEAD_DIM = HIDDEN // HEADS
VOCAB = 96
FLOAT16_FIELDS = {  # byte offsets of each block's float16 scale fields
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q5_1: (0, 2), Q.IQ4_XS: (0,), Q.IQ4_NL: (0,), Q.TQ1_0: (52,),
    Q.IQ3_S: (0,), Q.IQ3_XXS: (0,), Q.IQ2_S: (0,), Q.IQ2_XS: (0,), Q.IQ2_XXS: (0,), Q.IQ1_S: (0,),
    Q.IQ1_M: (),  # its float16 scale is in the top nibbles of bytes 49, 51, 53, 55 (random_blocks)
}
# One type per tensor role, so that one tiny model runs every type of the two embedded files (and Q4_0/Q4_1).
TYPES = {"token_embd": Q.Q4_K, "output": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q8_0, "attn_v": Q.Q5_0,
         "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.F16, "ffn_down": Q.Q6_K}
ALL_Q4K = {role: (Q.Q4_K if qtype not in (Q.F16,) else qtype) for role, qtype in TYPES.items()} | {"ffn_up": Q.Q4_K}


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int, scale: float) -> np.ndarray:
    """[rows, bytes] of blocks with random integer parts and float16 scales in +-`scale` (finite)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in FLOAT16_FIELDS[qtype]:
        values = rng.uniform(-scale, scale, size=(rows, cols // block)).astype(np.float16)
        raw[:, :, offset:offset + 2] = values.view(np.uint8).reshape(rows, cols // block, 2)
    if qtype == Q.IQ1_M:
        bits = rng.uniform(0, scale, size=(rows, cols // block)).astype(np.float16).view(np.uint16)
        for w in range(4):
            raw[:, :, 49 + 2 * w] = (raw[:, :, 49 + 2 * w] & 0x0F) | (((bits >> (4 * w)) & 0xF) << 4).astype(np.uint8)
    return raw.reshape(rows, -1)


# Per type, a float16 scale that keeps the decoded weights around 0.05 (the integer parts differ in range).
SCALES = {Q.IQ3_S: 0.0005, Q.IQ3_XXS: 0.0004, Q.IQ2_S: 0.001, Q.IQ2_XS: 0.001, Q.IQ2_XXS: 0.001,
          Q.IQ1_S: 0.005, Q.IQ1_M: 0.005, Q.Q2_K: 0.02, Q.Q3_K: 0.005, Q.Q5_1: 0.005, Q.IQ4_XS: 0.0005, Q.IQ4_NL: 0.0005, Q.TQ1_0: 0.05, Q.Q4_K: 0.01, Q.Q5_K: 0.005, Q.Q6_K: 0.0001, Q.Q5_0: 0.005, Q.Q8_0: 0.001, Q.Q4_0: 0.01, Q.Q4_1: 0.01}


def tensor_data(rng, qtype: Q, rows: int, cols: int) -> tuple[np.ndarray, Q | None]:
    if qtype == Q.F32:
        return rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32), None
    if qtype == Q.F16:
        return rng.normal(0, 0.05, size=(rows, cols)).astype(np.float16), None
    if qtype == Q.BF16:  # float32 values cut to their top 16 bits, as bytes
        bits = rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8), qtype
    return random_blocks(rng, qtype, rows, cols, SCALES[qtype]), qtype


# A byte-level BPE vocabulary of exactly VOCAB tokens: ChatML's three special tokens, space and newline in the
# byte alphabet, one merge, and the printable characters but four rare ones (absent characters are dropped).
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]  # bos 0, eos 1 as the model's metadata says
PRINTABLE = [chr(c) for c in range(33, 127) if chr(c) not in "`^~\\"]
TOKENS = SPECIALS + ["\u0120", "\u010a", "\u0120w"] + PRINTABLE
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_tokenizer(writer: GGUFWriter, chat_template: str | None = CHATML, controls: int = len(SPECIALS)) -> None:
    """`controls`: how many tokens from the first are control tokens (the specials)."""
    assert len(TOKENS) == VOCAB
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * controls + [1] * (VOCAB - controls))  # 3: control, 1: normal
    writer.add_token_merges(["\u0120 w"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def write_tiny_gguf(path: Path, arch: str = "qwen2", seed: int = 0, types: dict | None = None,
                    tied: bool = False, context: int = 256, tokenizer: bool | dict = False,
                    split_tensors: int = 0, padded: int = 0) -> Path:
    """With `tokenizer`, the file carries a byte-level tokenizer and a chat template, as a real model's does (a
    dict: `add_tokenizer`'s arguments). With `split_tensors`, the model is split into files of that many tensors,
    as llama.cpp's gguf-split splits one (PATH-00001-of-0000N.gguf, the metadata in the first): returns the
    first. With `padded`, the token embeddings and the head hold that many rows past the metadata's vocabulary (as a
    head padded for the kernels, Qwen2.5-7B's), the real rows those of the unpadded file."""
    types = types or TYPES
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch, split_max_tensors=split_tensors)
    writer.add_block_count(LAYERS)
    writer.add_context_length(context)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    if tokenizer:
        add_tokenizer(writer, **(tokenizer if isinstance(tokenizer, dict) else {}))

    def add(name: str, role: str, rows: int, cols: int, pad: int = 0) -> None:
        data, raw_type = tensor_data(rng, types[role], rows, cols)
        if pad:  # from a generator of their own, so that every other value is the unpadded file's
            data = np.concatenate([data, tensor_data(np.random.default_rng([seed, 1]), types[role], pad, cols)[0]])
        writer.add_tensor(name, data, raw_dtype=raw_type)

    add("token_embd.weight", "token_embd", VOCAB, HIDDEN, padded)
    if not tied:
        add("output.weight", "output", VOCAB, HIDDEN, padded)
    writer.add_tensor("output_norm.weight", (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))
    for i in range(LAYERS):
        b = f"blk.{i}"
        writer.add_tensor(f"{b}.attn_norm.weight", (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))
        writer.add_tensor(f"{b}.ffn_norm.weight", (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))
        add(f"{b}.attn_q.weight", "attn_q", HIDDEN, HIDDEN)
        add(f"{b}.attn_k.weight", "attn_k", KV_HEADS * HEAD_DIM, HIDDEN)
        add(f"{b}.attn_v.weight", "attn_v", KV_HEADS * HEAD_DIM, HIDDEN)
        add(f"{b}.attn_output.weight", "attn_output", HIDDEN, HIDDEN)
        add(f"{b}.ffn_gate.weight", "ffn_gate", FFN, HIDDEN)
        add(f"{b}.ffn_up.weight", "ffn_up", FFN, HIDDEN)
        add(f"{b}.ffn_down.weight", "ffn_down", HIDDEN, FFN)
        if arch == "qwen2":  # Qwen2 has q/k/v biases
            for role, rows in (("attn_q", HIDDEN), ("attn_k", KV_HEADS * HEAD_DIM), ("attn_v", KV_HEADS * HEAD_DIM)):
                writer.add_tensor(f"{b}.{role}.bias", rng.normal(0, 0.05, rows).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(path)[0]
