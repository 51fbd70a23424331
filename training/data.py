"""The trained pair's data: the Python standard library's sources as installed with Python (nothing downloaded).

    python -m training.data OUT_DIR [--force]

Selection: every `*.py` file under the interpreter's stdlib directory (`sysconfig` "stdlib"; site-packages
excluded), sorted by path relative to it, read as UTF-8 (the files that are not are skipped and listed). Code,
docstrings and `pydoc_data/topics.py` (the language reference's text) are all in it. Split by file: a file is held
out when the first byte of sha256(relative path) is below HELDOUT_BYTE (about 2 % of files), so the split does not
depend on which other files exist. Writes:

    OUT_DIR/tokenizer/       tokenizer.json + tokenizer_config.json: byte-level BPE, VOCAB_SIZE - 32 ranks trained
                             on the training files only, then the 32 special ids (Kimi's order, `builder.tokenizer`)
    OUT_DIR/train.npy        uint16 token ids, each file as [BOS] text [EOS]
    OUT_DIR/heldout.npy      the held-out files, the same way
    OUT_DIR/manifest.json    Python version, stdlib path, per split: files (path, bytes, sha256), tokens
    OUT_DIR/prompts.json     PROMPTS held-out prompts: the lines of a held-out file up to and including a `def`
                             line, at most PROMPT_TOKENS tokens (what the acceptance table and test run)

The manifest is what `training/data_manifest.json` records for the committed pair.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import platform
import sys
import sysconfig
from pathlib import Path

import numpy as np

from builder.tokenizer import SPECIAL_TOKENS, train_tokenizer, write_tokenizer
from engines.output_dir import staged_output_dir

VOCAB_SIZE = 4096
SPECIAL_BASE = VOCAB_SIZE - len(SPECIAL_TOKENS)
HELDOUT_BYTE = 5  # sha256(path)[0] < 5: 5 / 256, about 2 % of files


PROMPTS, PROMPT_TOKENS = 128, 96


def special_id(token: str) -> int:
    return SPECIAL_BASE + SPECIAL_TOKENS.index(token)


def stdlib_files(root: Path | None = None) -> tuple[Path, list[Path]]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p.relative_to(root) for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return root, files


def is_heldout(relative: Path) -> bool:
    return hashlib.sha256(relative.as_posix().encode()).digest()[0] < HELDOUT_BYTE


def read_corpus(root: Path, files: list[Path]) -> tuple[dict[str, list[tuple[Path, str]]], list[str]]:
    """{"train": [(path, text)], "heldout": [...]} and the paths skipped as not UTF-8."""
    splits: dict[str, list[tuple[Path, str]]] = {"train": [], "heldout": []}
    skipped = []
    for relative in files:
        try:
            text = (root / relative).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            skipped.append(relative.as_posix())
            continue
        splits["heldout" if is_heldout(relative) else "train"].append((relative, text))
    return splits, skipped


def heldout_prompts(items: list[tuple[Path, str]], tokenizer, count: int = PROMPTS) -> list[dict]:
    """Up to `count` prompts, taken round-robin over the held-out files: each the text that ends with a `def` line
    (the model continues with the function's body), trimmed from the front to PROMPT_TOKENS tokens by whole lines."""
    per_file = []
    for relative, text in items:
        lines = text.splitlines(keepends=True)
        found = []
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
                start = max(0, i - 12)
                while start < i and len(tokenizer.encode("".join(lines[start : i + 1])).ids) > PROMPT_TOKENS:
                    start += 1
                prompt = "".join(lines[start : i + 1])
                if len(tokenizer.encode(prompt).ids) <= PROMPT_TOKENS:
                    found.append({"file": relative.as_posix(), "line": i + 1, "text": prompt})
        per_file.append(found)
    prompts, depth = [], 0
    while len(prompts) < count and any(depth < len(f) for f in per_file):
        prompts += [f[depth] for f in per_file if depth < len(f)][: count - len(prompts)]
        depth += 1
    return prompts


def encode_files(tokenizer, texts: list[str]) -> np.ndarray:
    bos, eos = special_id("[BOS]"), special_id("[EOS]")
    ids = [[bos, *enc.ids, eos] for enc in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return np.fromiter((i for row in ids for i in row), dtype=np.uint16)


def prepare(output_dir: Path, force: bool, root: Path | None = None) -> dict:
    root, files = stdlib_files(root)
    if not files:
        raise ValueError(f"no *.py files under the stdlib directory {root}")
    splits, skipped = read_corpus(root, files)
    logging.info("stdlib %s: %d train files, %d held out", root, len(splits["train"]), len(splits["heldout"]))
    tokenizer = train_tokenizer(SPECIAL_BASE, (text for _, text in splits["train"]))
    manifest = {
        "source": "Python standard library sources (*.py, site-packages excluded)",
        "python": platform.python_version(),
        "stdlib": str(root),
        "split": f"held out when sha256(relative path)[0] < {HELDOUT_BYTE}",
        "vocab_size": VOCAB_SIZE,
        "skipped_not_utf8": skipped,
    }
    with staged_output_dir(output_dir, force) as out:
        (out / "tokenizer").mkdir()
        write_tokenizer(out / "tokenizer", SPECIAL_BASE, VOCAB_SIZE, tokenizer)
        for name, items in splits.items():
            ids = encode_files(tokenizer, [text for _, text in items])
            np.save(out / f"{name}.npy", ids)
            manifest[name] = {
                "files": len(items),
                "bytes": sum(len(text.encode()) for _, text in items),
                "tokens": int(ids.size),
                "list": [
                    [p.as_posix(), len(t.encode()), hashlib.sha256(t.encode()).hexdigest()[:16]] for p, t in items
                ],
            }
            logging.info("%s: %d files, %d tokens", name, len(items), ids.size)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        prompts = heldout_prompts(splits["heldout"], tokenizer)
        (out / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
        logging.info("%d held-out prompts", len(prompts))
    return manifest


def load_split(data_dir: Path, name: str) -> np.ndarray:
    path = Path(data_dir) / f"{name}.npy"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: prepare the data with `python -m training.data {data_dir}`")
    return np.load(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--stdlib", type=Path, default=None, help="another stdlib directory (default: this Python's)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        prepare(args.output_dir, args.force, args.stdlib)
    except (FileExistsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
