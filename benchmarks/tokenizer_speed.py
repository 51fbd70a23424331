"""The two tokenizer layouts a checkpoint ships, on the same BPE: `tokenizer.json` (the `tokenizers` library) and
Kimi K2.x's release layout (`tiktoken.model` + `tokenizer_config.json`, the `tiktoken` library with Kimi's
pre-tokenizer pattern), as the runner loads them (`runner.tokenizer.load_tokenizer`).

    PYTHONPATH=. python3 benchmarks/tokenizer_speed.py OUT_DIR [--repeats 5]

The BPE is the trained pair's (`trained/kimi-k2-py`, 4096 ids: 4064 ranks and Kimi's 32 special tokens); the
release layout is written from it. The text: the held-out files of the pair's data (the Python standard library,
`trained/data_manifest.json`). Measured: encoding all of it, decoding the ids back, and streaming detokenisation
one token at a time, as `--streaming` and the Triton model emit text: `runner.tokenizer.Detokenizer` (a window
from the last complete text) over all the tokens, and the former way (the whole output decoded at every token)
over the first --stream_tokens; medians of --repeats; round trips checked. Writes OUT_DIR/tokenizer_speed.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "trained"


def timed(fn, repeats: int):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stream_tokens", type=int, default=4096, help="tokens streamed the former way")
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    from benchmarks.common import environment
    from builder.tokenizer import write_tiktoken_tokenizer
    from runner.tokenizer import Detokenizer, load_tokenizer

    manifest = json.loads((ROOT / "data_manifest.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])  # this Python's (the manifest records the one the pair used)
    names = [entry[0] for entry in manifest["heldout"]["list"]]  # [relative path, bytes, hash]
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in names if (stdlib / name).exists()]
    text = "\n".join(texts)
    vocab = manifest["vocab_size"]
    info = {**environment(False), "command": " ".join(sys.argv), "files": len(texts), "characters": len(text),
            "bytes": len(text.encode()), "rows": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        release = Path(tmp)
        bpe = Tokenizer.from_file(str(ROOT / "kimi-k2-py" / "tokenizer.json"))
        write_tiktoken_tokenizer(release, vocab - 32, vocab, bpe)
        layouts = {"tokenizer.json (tokenizers)": load_tokenizer(ROOT / "kimi-k2-py", vocab),
                   "tiktoken.model (tiktoken, Kimi's pattern)": load_tokenizer(release, vocab)}  # fmt: skip
        for name, tokenizer in layouts.items():
            ids, encode_s = timed(lambda t=tokenizer: t.encode(text), args.repeats)
            back, decode_s = timed(lambda t=tokenizer, i=ids: t.decode(i), args.repeats)

            def stream(t=tokenizer, i=ids) -> str:
                d = Detokenizer(t)
                return "".join(d.push([token]) for token in i) + d.finish()

            def stream_whole(t=tokenizer, i=ids[: args.stream_tokens]) -> int:  # the former way
                printed = 0
                for end in range(1, len(i) + 1):
                    out = t.decode(i[:end], skip_special_tokens=True)
                    if not out.endswith("\ufffd"):
                        printed = len(out)
                return printed

            streamed, stream_s = timed(stream, args.repeats)
            _, whole_s = timed(stream_whole, 1)
            row = {"layout": name, "tokens": len(ids), "encode_s": encode_s, "decode_s": decode_s,
                   "stream_s": stream_s, "encode_mb_per_s": info["bytes"] / encode_s / 1e6,
                   "encode_tokens_per_s": len(ids) / encode_s, "decode_tokens_per_s": len(ids) / decode_s,
                   "stream_us_per_token": stream_s / len(ids) * 1e6,
                   "former_stream_tokens": min(len(ids), args.stream_tokens),
                   "former_stream_us_per_token": whole_s / min(len(ids), args.stream_tokens) * 1e6,
                   "round_trip": back == text and streamed == text}  # fmt: skip
            info["rows"].append(row)
            print(f"{name:45s} {len(ids):8d} tokens; encode {row['encode_mb_per_s']:6.2f} MB/s "
                  f"({row['encode_tokens_per_s'] / 1e6:.2f} M tokens/s); decode {row['decode_tokens_per_s'] / 1e6:.2f} "
                  f"M tokens/s; streaming {row['stream_us_per_token']:.2f} us a token (former way, first "
                  f"{row['former_stream_tokens']}: {row['former_stream_us_per_token']:.1f}); round trip "
                  f"{row['round_trip']}",
                  flush=True)  # fmt: skip
        first, second = (layouts[n].encode(text) for n in layouts)
        info["same_ids"] = first == second
        print("same ids in both layouts:", info["same_ids"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "tokenizer_speed.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
