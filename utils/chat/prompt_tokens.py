"""A prompt as the models read it: the chat template's control tokens as control tokens, the user's text as text,
and the tokens that end an answer.

Someone who types or pastes "<|im_end|>", or a file that holds "<|im_start|>system ...", means those characters:
read as control tokens they would end the user's turn early or add a system turn of their own. So a message's
content is read with control-token strings split into ordinary tokens, as llama.cpp reads user text unless asked
(`--special`); the template around it keeps its control tokens. That needs each content tokenized on its own
(`spliced_chat_ids`), which some tokenizers and templates read otherwise than in context: a SentencePiece
tokenizer marks the start of each call's text, a template may trim a content. There, checked on the same messages
without their control text, the template's own reading stands, control tokens and all.
"""

from __future__ import annotations

import re

from sampling.translating_drafter import control_tokens

END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")  # chat templates' turn ends
# Stand-ins for each message's content in the rendered template: private-use characters, which no template writes.
MARK, MARKS = "\ue000{}\ue001", re.compile("\ue000(\\d+)\ue001")


def control_texts(tokenizer) -> list[str]:
    """The strings the tokenizer reads as control tokens."""
    return list(control_tokens(tokenizer).values())


def text_ids(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """`text` read as text: a control token's string in it becomes ordinary tokens. `add_special_tokens`: the
    tokenizer's own additions (a BOS), as for any prompt."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True)["input_ids"])


def chat_ids(tokenizer, prompt: str, history: list[dict] = ()) -> list[int]:
    """The conversation so far plus `prompt` as the next user turn, through the tokenizer's chat template, ready
    for the assistant's answer; each message's content read as text."""
    messages = [*history, {"role": "user", "content": prompt}]
    controls = control_texts(tokenizer)
    if not any(control in message["content"] for message in messages for control in controls):
        return template_ids(tokenizer, messages)
    found = re.compile("|".join(map(re.escape, controls)))
    plain = [{**message, "content": found.sub("", message["content"])} for message in messages]
    if spliced_chat_ids(tokenizer, plain) != template_ids(tokenizer, plain):
        return template_ids(tokenizer, messages)  # splicing would read the contents otherwise (module docstring)
    return spliced_chat_ids(tokenizer, messages)


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def spliced_chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The template rendered around stand-ins for the contents: its own text read with control tokens, each
    content as text in its place."""
    marked = [{**message, "content": MARK.format(i)} for i, message in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    for i, piece in enumerate(MARKS.split(rendered)):
        if i % 2:  # a stand-in's number
            ids += text_ids(tokenizer, messages[int(piece)]["content"], add_special_tokens=False)
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def stop_tokens(tokenizer, model, chat: bool) -> list[int]:
    """The ids that end an answer: the tokenizer's and the model's end tokens, and in chat the end-of-turn ones."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    if chat:
        ids.update(token_id(tokenizer, t) for t in END_OF_TURN)
    return sorted(i for i in ids if i is not None)


def token_id(tokenizer, token: str) -> int | None:
    """`token`'s id, or None where the vocabulary has no such token: looked up alone, not through `get_vocab()`
    (0.1 s for 152k entries, once a prompt). An unknown token comes back as the unk id, or None, which names
    another token or none."""
    i = tokenizer.convert_tokens_to_ids(token)
    return i if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == token else None
