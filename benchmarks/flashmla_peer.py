"""TreeAttention next to DeepSeek's FlashMLA (Hopper dense decode, the peer) at one Kimi K2.x TP-8 rank's shapes,
both timed in the same run. FlashMLA is built on the GPU machine from `../shared/peers/flashmla` and is never part
of the project:

    cp -r ../shared/peers/flashmla .peers/flashmla        (once, in the checkout; .peers/ is git-ignored)
    GPU machine:  (cd .peers/flashmla && python3 build_dense.py) && \
                  PYTHONPATH=.peers/flashmla:. python3 benchmarks/flashmla_peer.py OUT_DIR

Shapes: 8 query heads (64 / TP-8), latent rows of 576 (512 values + 64 rope), bf16, Kimi's softmax scale, T query
tokens over S cached rows, T in {1, 8, 33}, S in {4096, 32768, 131072}. FlashMLA has no tree mask, so a FlashMLA
tree verify is a composition: its kernel over the cache for the T queries (non-causal, it returns the log-sum-exp),
the T x T tree part under the mask (here in torch ops), and a log-sum-exp merge; "FlashMLA cache part" is its kernel
alone, a lower bound of any FlashMLA-based verify. At T = 1 FlashMLA's decode reads the new row from the cache
(S + 1 rows), which is how a decode runs it. Every row checks both against the float64 reference first
(`plugins/tree_attention/reference.py`). Times: CUDA-graph replays (20 calls a replay), medians; floor =
max(bytes / copy rate, flops / matmul rate), the rates measured in the run. Writes OUT_DIR/flashmla_peer.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton

from benchmarks.common import environment
from benchmarks.tree_attention_gpu import LATENT, ROPE, ceilings, floor_us, graph_time_us, inputs, relative_error
from plugins.tree_attention.kernel import tree_attention_cuda

HEADS, PAGE = 8, 64
SCALE = (192**-0.5) * (0.1 * math.log(64.0) + 1.0) ** 2  # Kimi: qk head 192, YaRN factor 64: mscale^2


def tree_part(q, new_kv, mask):
    """The T x T tree part in float32: (output [T, H, 512], log-sum-exp [T, H])."""
    scores = torch.einsum("thd,kd->thk", q.float(), new_kv.float()) * SCALE
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("thk,kc->thc", torch.exp(scores - lse[..., None]), new_kv[:, :LATENT].float()), lse


def merged(out_a, lse_a, out_b, lse_b):
    """softmax over the union of two key sets from each one's normalised output and log-sum-exp."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return (out_a.float() * wa + out_b * wb) / (wa + wb)


def shape_row(tokens: int, length: int, ceil: dict) -> dict:
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    q, cache, length_t, new_kv, mask = inputs(tokens, HEADS, length, seed=tokens + length)
    pages = triton.cdiv(length + tokens, PAGE)
    paged = torch.zeros(pages * PAGE, LATENT + ROPE, dtype=torch.bfloat16, device="cuda")
    paged[:length] = cache[:length]
    if tokens == 1:
        paged[length] = new_kv[0]  # a decode appends its row first
    table = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    rows_seen = torch.tensor([length + (1 if tokens == 1 else 0)], dtype=torch.int32, device="cuda")
    kv = paged.view(pages, PAGE, 1, LATENT + ROPE)
    meta, _ = get_mla_metadata()
    out = torch.empty(tokens, HEADS, LATENT, dtype=torch.bfloat16, device="cuda")

    def ours():
        tree_attention_cuda(q, cache, length_t, new_kv, mask, SCALE, LATENT, out=out)

    def peer_cache_part():
        return flash_mla_with_kvcache(q[None], kv, table, rows_seen, LATENT, meta, None, softmax_scale=SCALE,
                                      causal=False)  # fmt: skip

    def peer_verify():
        prefix, lse = peer_cache_part()
        tree_out, tree_lse = tree_part(q, new_kv, mask)
        return merged(prefix[0], lse[0].transpose(0, 1), tree_out, tree_lse)

    ours()
    peer = peer_cache_part()[0][0] if tokens == 1 else peer_verify()
    errors = {name: relative_error(got, q, cache, length_t, new_kv, mask, SCALE) for name, got in (("ours", out),
              ("flashmla", peer))}  # fmt: skip
    row = {"T": tokens, "H": HEADS, "S": length, "ours_rel_error": errors["ours"],
           "flashmla_rel_error": errors["flashmla"]}  # fmt: skip
    floor, bytes_moved, flops = floor_us(tokens, HEADS, length, ceil)
    row.update(floor_us=floor, bytes=bytes_moved, flops=flops, ours_us=graph_time_us(ours),
               flashmla_cache_part_us=graph_time_us(peer_cache_part))  # fmt: skip
    row["flashmla_verify_us"] = row["flashmla_cache_part_us"] if tokens == 1 else graph_time_us(peer_verify)
    for name in ("ours", "flashmla_cache_part", "flashmla_verify"):
        row[f"{name}_x_floor"] = row[f"{name}_us"] / floor
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    started = time.time()
    ceil = ceilings()
    print(f"copy {ceil['copy_GBps']:.0f} GB/s, bf16 {ceil['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    rows = []
    for length in (4096, 32768, 131072):
        for tokens in (1, 8, 33):
            rows.append(shape_row(tokens, length, ceil))
            print(json.dumps(rows[-1]), flush=True)
    result = {**environment(False), "command": " ".join(sys.argv), "ceilings": ceil, "seconds": time.time() - started,
              "rows": rows}  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "flashmla_peer.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        "\n| T | S | floor (µs) | TreeAttention (µs) | × floor | FlashMLA cache part (µs) | FlashMLA verify (µs) | "
        "× floor | ours / FlashMLA verify | errors (ours, FlashMLA) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    for r in rows:
        print(
            f"| {r['T']} | {r['S']} | {r['floor_us']:.1f} | {r['ours_us']:.1f} | {r['ours_x_floor']:.2f} | "
            f"{r['flashmla_cache_part_us']:.1f} | {r['flashmla_verify_us']:.1f} | {r['flashmla_verify_x_floor']:.2f} | "
            f"{r['ours_us'] / r['flashmla_verify_us']:.2f} | {r['ours_rel_error']:.1e}, {r['flashmla_rel_error']:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
