"""The engine's tokenizer on rank 0: loading, prompt encoding with a length bound checked before the work, and
incremental detokenisation for streaming."""

from __future__ import annotations

import sys
from pathlib import Path


def load_tokenizer(path: Path, vocab_size: int):
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer_dir {path} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(file))
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(
            f"the tokenizer in {path} has {tokenizer.get_vocab_size()} ids but the engine's vocab_size is {vocab_size}"
        )
    return tokenizer


_LONGEST_TOKEN: dict[int, int] = {}


def encode_prompt(tokenizer, text: str, max_input_len: int) -> list[int]:
    """The prompt's ids. A text that cannot fit max_input_len tokens is refused before it is tokenized: no token
    covers more bytes than the vocabulary's longest entry, so a 64 MB prompt is not tokenized (seconds of the only
    thread that serves requests) just to be refused."""
    if id(tokenizer) not in _LONGEST_TOKEN:  # tokenizers live as long as the process
        _LONGEST_TOKEN[id(tokenizer)] = max(len(token.encode()) for token in tokenizer.get_vocab())
    longest = _LONGEST_TOKEN[id(tokenizer)]
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_input_len * longest:
        raise ValueError(
            f"prompt of {size} bytes is at least {-(-size // longest)} tokens, longer than the engine's "
            f"max_input_len={max_input_len}"
        )
    return tokenizer.encode(text).ids


class TextStream:
    """Incremental detokenisation: prints the new text of the growing token list (holds back a partial char)."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.tokens, self.printed = tokenizer, out, [], 0

    def __call__(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)
