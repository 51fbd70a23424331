"""An offline byte-level BPE tokenizer with Kimi's special tokens, for the tiny demo checkpoints.

Kimi K2.x ships a tiktoken model with 163,584 BPE ranks followed by 256 reserved special ids. The tiny tokenizer
keeps the shape: BPE ranks [0, special_base) trained deterministically on a built-in corpus, then the special
block [special_base, vocab_size) in Kimi's order ([BOS], [EOS], <|im_end|>, ... with [UNK], the DFlash mask
token, and [PAD] as the last two ids).
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|reserved_token_5|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_token_8|>",
    "[EOT]",
    "<|im_system|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|reserved_token_16|>",
    "<|im_middle|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<think>",
    "</think>",
    "<|reserved_token_24|>",
    "<|reserved_token_25|>",
    "<|reserved_token_26|>",
    "<|reserved_token_27|>",
    "<|reserved_token_28|>",
    "<|reserved_token_29|>",
    "[UNK]",
    "[PAD]",
]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}{%- endif -%}"
)

CORPUS = """\
Speculative decoding lets a small drafter propose several tokens that a large target model verifies in a single
forward pass. When the drafter guesses well, the target accepts a whole run of tokens at once, and the output is
exactly what the target alone would have produced. A block diffusion drafter writes a block of eight tokens in
one step: the first is the last token the target emitted, the rest are mask tokens that the drafter fills in.
A dynamic draft tree keeps the most probable prefixes under a node budget, and the target checks every branch
with one tree attention mask. The longest path that matches the target's own choices is accepted, its key and
value cache rows are committed, and every other branch is dropped. Tensor parallel ranks each hold a slice of
the attention heads and of every expert, and an all reduce joins their partial sums. The latent cache of the
attention layers stores five hundred and twelve compressed values plus sixty four rotary values per token.
Kimi is a large mixture of experts model: each token is routed to eight of three hundred and eighty four experts,
and a shared expert sees every token. Hello world! How are you today? The weather is fine, thank you very much.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 33 64 128 256 512 1024 2048 4096 8192 32768 131072.
def generate(prompt, max_new_tokens): return engine.run(prompt) # code, too: for i in range(8): print(i)
"""


def train_tokenizer(special_base: int, corpus=None):
    """BPE ranks [0, special_base) trained on `corpus` (an iterable of strings; the built-in text when None), then
    the special block."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=special_base, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS.splitlines() if corpus is None else corpus, trainer)
    if tokenizer.get_vocab_size() != special_base:
        raise RuntimeError(f"BPE training gave {tokenizer.get_vocab_size()} ranks, expected {special_base}")
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def write_tokenizer(model_dir: Path, special_base: int, vocab_size: int, tokenizer=None) -> None:
    """tokenizer.json (the given `tokenizers.Tokenizer`, or one trained on the built-in text) and
    tokenizer_config.json with the chat template."""
    tokenizer = train_tokenizer(special_base) if tokenizer is None else tokenizer
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} ids, the model {vocab_size}")
    tokenizer.save(str(Path(model_dir) / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "add_bos_token": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (Path(model_dir) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's bytes_to_unicode): char -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def write_tiktoken_tokenizer(model_dir: Path, special_base: int, vocab_size: int, tokenizer=None) -> None:
    """The same tokenizer (the given byte-level BPE `tokenizers.Tokenizer`, or one trained on the built-in text) in
    Kimi K2.x's release layout: `tiktoken.model` (base64 token bytes and rank, one per line, ranks
    [0, special_base)) and `tokenizer_config.json` naming the special block in `added_tokens_decoder`."""
    import base64

    tokenizer = train_tokenizer(special_base) if tokenizer is None else tokenizer
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} ids, the model {vocab_size}")
    to_byte = byte_level_alphabet()
    lines = []
    for token, rank in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if rank < special_base:
            data = bytes(to_byte[c] for c in token)
            lines.append(f"{base64.b64encode(data).decode()} {rank}")
    (Path(model_dir) / "tiktoken.model").write_text("\n".join(lines) + "\n")
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": {
            str(special_base + i): {"content": name, "special": True} for i, name in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (Path(model_dir) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
