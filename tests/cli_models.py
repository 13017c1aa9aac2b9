"""A tiny random model with a real tokenizer and a chat template, saved as a local folder for the CLI tests."""

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = ["<unk>", "<eos>", "<|im_end|>", "<|im_start|>"] + [f"w{i}" for i in range(60)] + [
    "user", "assistant", "hello", "world", "write", "code", "a", "function", ":", "\n"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} : {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant : {% endif %}"
)


def write_tiny_model(folder, seed: int = 0, context: int = 4096, extra_words: int = 0) -> None:
    """`extra_words`: the vocabulary goes on past WORDS (x0, x1, ...), and the head always picks x0 or x1 (a drafter
    whose vocabulary is the target's and more)."""
    words = WORDS + [f"x{i}" for i in range(extra_words)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                        additional_special_tokens=["<|im_end|>", "<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                         bos_token_id=0, eos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(config)
    if extra_words:
        with torch.no_grad():  # x0 wins where the last hidden state's first value is > 0, x1 elsewhere
            model.lm_head.weight.zero_()
            model.lm_head.weight[len(WORDS), 0], model.lm_head.weight[len(WORDS) + 1, 0] = 100.0, -100.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def tiny_session(folder, **settings):
    """A chat session on the tiny model written to `folder` (it drafts for itself), its messages kept in a
    StringIO at `.out`."""
    import io

    from utils.chat.session import Session
    from utils.chat.settings import Settings
    from utils.models.model_loader import load_model

    write_tiny_model(folder)
    model, tokenizer = load_model(str(folder), device="cpu", dtype="float32", progress=False)
    chat = Session(model, model, tokenizer, Settings(**settings), json_mode=False)
    chat.out = io.StringIO()
    return chat
