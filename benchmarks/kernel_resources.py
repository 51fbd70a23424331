"""What Triton compiles TreeAttention's split kernel to for a Hopper GPU, on any machine (no GPU, no CUDA driver):
registers a thread, spilled stores, shared memory a block, tensor-core instructions (Hopper's wgmma, the older
mma.sync) and asynchronous copies (cp.async, TMA), for each form the launcher takes at the verify and decode shapes
and for the forms `benchmarks/tree_attention_gpu.py` times beside them.

    python benchmarks/kernel_resources.py OUT [--capability 90] [--keys-major]

Triton compiles ahead of time with the ptxas it ships; the arguments are typed and hinted as the JIT sees them on a
GPU (bf16 tensors from torch: 16-byte aligned pointers, rows of 576 elements, so every pointer and stride is
divisible by 16; without that hint no cache load is pipelined). Counts are of instructions in the code, not of
instructions run. Writes OUT/kernel_resources.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from plugins.tree_attention import kernel  # noqa: E402

LATENT, ROPE = 512, 64  # Kimi K2.x's MLA: kv_lora_rank, qk_rope_head_dim
POINTERS = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "length_ptr": "*i64", "new_ptr": "*bf16", "mask_ptr": "*u8",
            "part_out": "*fp32", "part_m": "*fp32", "part_l": "*fp32"}  # fmt: skip
INTEGERS = {"T": "i32", "H": "i32", "qk_scale": "fp32", "cache_stride": "i32", "cache_batch_stride": "i32",
            "new_stride": "i32", "num_splits": "i32"}  # fmt: skip
DIVISIBLE = (*POINTERS, "cache_stride", "cache_batch_stride", "new_stride")  # by 16, as the JIT specializes them
# (T, H, capacity): a decode (T = 1), a drafter-sized verify (T = 8), DDTree 32's verify at 8 and 16 heads (a Kimi
# K2.x TP-8 rank has 8), over a long cache
SHAPES = [(1, 8, 131072), (8, 8, 131072), (33, 8, 131072), (33, 16, 131072)]


def split_form(tokens: int, heads: int, capacity: int, overrides: dict | None = None) -> dict:
    """The split kernel's form the launcher takes at this shape (`kernel.launch_config`), `overrides` applied."""
    return kernel.launch_config(tokens, heads, LATENT, ROPE, 2, capacity, overrides)


def compile_split(form: dict, capability: int = 90):
    """The split kernel of `form` compiled for sm_`capability` (Triton's CompiledKernel)."""
    block_dl, block_dr = kernel.padded_widths(LATENT, ROPE)
    constants = dict(D_LAT=LATENT, D_ROPE=ROPE, BLOCK_DL=block_dl, BLOCK_DR=block_dr, BLOCK_M=form["block_m"],
                     BLOCK_N=form["block_n"], MIN_BLOCKS=form["min_blocks"], PRECISION="tf32",
                     WHOLE_BLOCKS=form["whole_blocks"])  # fmt: skip
    signature = dict(POINTERS)
    fn = kernel._tree_attention_split_keys_major if form["keys_major"] else kernel._tree_attention_split
    if form["tma"]:
        signature["lat_desc"] = f"tensordesc<bf16[1,{form['block_n']},{block_dl}]>"
        signature["rope_desc"] = f"tensordesc<bf16[1,{form['block_n']},{block_dr}]>"
    else:
        signature["lat_desc"] = signature["rope_desc"] = "constexpr"
        constants.update(lat_desc=None, rope_desc=None)
    constants["USE_TMA"] = form["tma"]
    signature.update(INTEGERS)
    signature.update(dict.fromkeys([k for k in constants if k not in signature], "constexpr"))
    names = list(signature)
    assert names == list(fn.arg_names), (names, fn.arg_names)  # the kernel's arguments, in order
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": form["num_warps"], "num_stages": form["num_stages"]}
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def resources(compiled) -> dict:
    """Registers a thread, spilled stores (STL in the SASS), shared memory a block and the instruction counts."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    ptx = compiled.asm["ptx"]
    return {
        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
        "spill_stores": len(re.findall(r"\bSTL\b", sass)),
        "shared_bytes": compiled.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma_sync": ptx.count("mma.sync"),
        "cp_async": len(re.findall(r"cp\.async\.c[ag]\.shared", ptx)),
        "tma_loads": ptx.count("cp.async.bulk.tensor"),
    }


def measure(tokens: int, heads: int, capacity: int, overrides: dict | None = None, capability: int = 90) -> dict:
    form = split_form(tokens, heads, capacity, overrides)
    started = time.perf_counter()
    compiled = compile_split(form, capability)
    row = {"T": tokens, "H": heads, "capacity": capacity, "form": form, **resources(compiled)}
    row["fits_a_block"] = row["shared_bytes"] <= kernel.HOPPER_BLOCK_SHARED
    row["compile_s"] = round(time.perf_counter() - started, 2)
    return row


KEYS_MAJOR = [dict(keys_major=True, block_m=m, block_n=64, num_warps=w, num_stages=s, whole_blocks=True, tma=tma)
              for m, w, s in ((32, 4, 2), (32, 8, 2), (16, 4, 2), (64, 8, 2), (32, 4, 3))
              for tma in (False, True)]  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--capability", type=int, default=90, help="the GPU's compute capability (90: Hopper)")
    parser.add_argument("--keys-major", action="store_true", help="also the keys-major forms at T = 33, H = 8")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_CACHE_DIR", str(args.out_dir / "triton-cache"))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tried = [(shape, None) for shape in SHAPES]
    if args.keys_major:
        tried += [((33, 8, 131072), form) for form in KEYS_MAJOR]
    rows = []
    print("| T | H | form | registers | spilled stores | shared KB | fits | wgmma | mma.sync | cp.async | TMA |")
    print("|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for (tokens, heads, capacity), overrides in tried:
        row = measure(tokens, heads, capacity, overrides, args.capability)
        rows.append(row)
        f = row["form"]
        extras = ", whole" * f["whole_blocks"] + ", TMA" * f["tma"]
        name = (f"{'keys-major ' if f['keys_major'] else ''}{f['block_m']}x{f['block_n']}, {f['num_warps']} warps, "
                f"{f['num_stages']} stages{extras}")  # fmt: skip
        print(f"| {tokens} | {heads} | {name} | {row['registers']} | {row['spill_stores']} | "
              f"{row['shared_bytes'] / 1024:.0f} | {'yes' if row['fits_a_block'] else 'no'} | {row['wgmma']} | "
              f"{row['mma_sync']} | {row['cp_async']} | {row['tma_loads']} |", flush=True)  # fmt: skip
    result = {"triton": triton.__version__, "capability": args.capability, "date": time.strftime("%Y-%m-%d"),
              "commit": os.environ.get("DDTREE_COMMIT"), "rows": rows}  # fmt: skip
    (args.out_dir / "kernel_resources.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
