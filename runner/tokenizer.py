"""The engine's tokenizer on rank 0, in either format a checkpoint ships:

- `tokenizer.json` (the `tokenizers` library): the demo checkpoints, most HF releases;
- `tiktoken.model` + `tokenizer_config.json`, as Kimi K2.x is released (its `tokenization_kimi.py` is remote code
  that transformers runs only with trust_remote_code): BPE ranks read and applied by the `tiktoken` library with
  Kimi's pre-tokenizer pattern, the special block from `added_tokens_decoder` (ids it does not name are
  `<|reserved_token_N|>`, as the release names them).

Both give the same small interface: `encode(text) -> ids` (special-token text becomes its id), `decode(ids,
skip_special_tokens)`, `vocab_size`, `token_id(text)`, `longest_token_bytes`, and `config` (tokenizer_config.json:
the chat template). Also here: prompt encoding with a length bound checked before the work, and incremental
detokenisation for streaming.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Kimi K2.x's pre-tokenizer (tokenization_kimi.py's pat_str): o200k's scheme with Han runs split off first.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def _config(path: Path) -> dict:
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from err


class HFTokenizer:
    """`tokenizer.json`, through the `tokenizers` library."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.vocab_size = self.backend.get_vocab_size()
        self.config = _config(path)
        self.longest_token_bytes = max(len(token.encode()) for token in self.backend.get_vocab())

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)


class TiktokenTokenizer:
    """`tiktoken.model` + `tokenizer_config.json` (Kimi K2.x's release layout), through the `tiktoken` library.
    vocab_size: the engine's; the ids past the BPE ranks are the special block."""

    def __init__(self, path: Path, vocab_size: int):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(str(path / "tiktoken.model"))
        self.config = _config(path)
        base = len(ranks)
        if vocab_size <= base:
            raise ValueError(f"{path}/tiktoken.model has {base} BPE ranks; the engine's vocab_size={vocab_size} leaves "
                             f"no room for the special tokens")  # fmt: skip
        names = {i: f"<|reserved_token_{i}|>" for i in range(base, vocab_size)}
        for key, entry in (self.config.get("added_tokens_decoder") or {}).items():
            if not base <= int(key) < vocab_size:
                raise ValueError(f"{path}/tokenizer_config.json names special token {entry.get('content')!r} with id "
                                 f"{key}, outside the special block [{base}, {vocab_size})")  # fmt: skip
            names[int(key)] = entry["content"]
        self.special = {name: i for i, name in names.items()}
        self.special_ids = frozenset(names)
        self.encoding = tiktoken.Encoding(path.name or "kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                          special_tokens=self.special)  # fmt: skip
        self.vocab_size = vocab_size
        self.longest_token_bytes = max(max(len(t) for t in ranks), max(len(n.encode()) for n in self.special))

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self.encoding.decode(ids)

    def token_id(self, text: str) -> int | None:
        if text in self.special:
            return self.special[text]
        ids = self.encoding.encode(text, allowed_special="all")
        return ids[0] if len(ids) == 1 else None


def load_tokenizer(path: Path, vocab_size: int):
    """The tokenizer in `path`: tokenizer.json, or tiktoken.model with tokenizer_config.json (Kimi K2.x)."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        tokenizer = HFTokenizer(path)
    elif (path / "tiktoken.model").is_file():
        tokenizer = TiktokenTokenizer(path, vocab_size)
    else:
        raise FileNotFoundError(f"tokenizer_dir {path} has neither tokenizer.json nor tiktoken.model")
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer in {path} has {tokenizer.vocab_size} ids but the engine's vocab_size is {vocab_size}"
        )
    return tokenizer


def encode_prompt(tokenizer, text: str, max_input_len: int) -> list[int]:
    """The prompt's ids. A text that cannot fit max_input_len tokens is refused before it is tokenized: no token
    covers more bytes than the vocabulary's longest entry, so a 64 MB prompt is not tokenized (seconds of the only
    thread that serves requests) just to be refused."""
    longest = tokenizer.longest_token_bytes
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_input_len * longest:
        raise ValueError(
            f"prompt of {size} bytes is at least {-(-size // longest)} tokens, longer than the engine's "
            f"max_input_len={max_input_len}"
        )
    return tokenizer.encode(text)


class Detokenizer:
    """Incremental detokenisation at a constant cost a token: each `push` decodes only the tokens since the last
    text it completed (a window from the previous read offset, as vLLM's and TGI's detokenizers keep), returns the
    new text and holds back a partial character. Decoding the whole list every call instead costs O(n) a token and
    O(n^2) a response. The new text is the difference of two decodes that start at the same token, so a decoder that
    treats a sequence's first token specially gives the same text as decoding everything at once."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.tokens: list[int] = []
        self.prefix = self.read = 0  # window start; the end of the text already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, new_tokens: list[int]) -> str:
        self.tokens.extend(new_tokens)
        done = self._decode(self.tokens[self.prefix : self.read])
        text = self._decode(self.tokens[self.prefix :])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return text[len(done) :]

    def finish(self) -> str:
        """Whatever is held back (a character that never completed ends as U+FFFD, as a whole decode shows it)."""
        done = self._decode(self.tokens[self.prefix : self.read])
        text = self._decode(self.tokens[self.prefix :])
        self.prefix = self.read = len(self.tokens)
        return text[len(done) :]


class TextStream:
    """Prints a generation's text as its tokens arrive (`Detokenizer`); `finish` prints what was held back."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.detokenizer, self.out = Detokenizer(tokenizer), out

    def __call__(self, new_tokens: list[int]) -> None:
        self._write(self.detokenizer.push(new_tokens))

    def finish(self) -> None:
        self._write(self.detokenizer.finish())

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
