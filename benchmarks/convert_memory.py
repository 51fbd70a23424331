"""Peak memory and read rate of `build-engine convert` on a synthetic INT4 checkpoint with Kimi K2.x's real per-layer
dimensions (hidden 7168, MLA 64 heads, 384 experts of width 2048 packed W4A16 with groups of 32, vocab 163840):
the first dense layer plus --moe_layers MoE layers, and a one-layer DFlash drafter at its real width. One MoE layer
is 9.5 GB packed; the whole model's 60 would be 570 GB.

    python benchmarks/convert_memory.py WORKDIR [--moe_layers 2] [--tp_size 8] [--max_shard_size 1GiB]
                                        [--repeats 3] [--out benchmarks/results/convert_memory.json] [--smoke]

Writes the checkpoint under WORKDIR (HF-style: one file per layer group, experts in files of 64; kept for the next
run with the same dimensions), then runs
`python -m builder.cli convert` --repeats times as a user would, sampling the process's resident memory every 50 ms
from /proc (VmRSS; RssAnon: what convert allocated; RssFile: safetensors' memory-mapped pages of the source, which
the kernel can drop). `--smoke` uses the tiny model's dimensions (checks the script).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment  # noqa: E402
from builder.demo_checkpoints import drafter_hf_config, target_hf_config  # noqa: E402
from models.config import DrafterConfig, TargetConfig  # noqa: E402
from models.layout import hf_drafter_specs, hf_target_specs  # noqa: E402

GROUP = 32
EXPERTS_PER_FILE = 64


def kimi_configs(moe_layers: int, smoke: bool) -> tuple[dict, dict]:
    """HF config.json dicts: Kimi K2.x's dimensions (or the tiny model's) with 1 + moe_layers layers, experts INT4."""
    target = target_hf_config(int4_experts=True)
    target["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 8 if smoke else GROUP
    drafter = drafter_hf_config()
    if not smoke:
        target.update(vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                      num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384, num_experts_per_tok=8,
                      n_group=1, topk_group=1, torch_dtype="bfloat16")  # fmt: skip
        drafter.update(vocab_size=163840, hidden_size=7168, intermediate_size=18432, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=128, torch_dtype="bfloat16")  # fmt: skip
    target.update(num_hidden_layers=1 + moe_layers, first_k_dense_replace=1)
    drafter.update(num_hidden_layers=1)
    drafter["dflash_config"] = {**drafter.get("dflash_config", {}), "target_layer_ids": list(range(1 + moe_layers))}
    drafter["bos_token_id"], drafter["eos_token_id"] = target["bos_token_id"], target["eos_token_id"]
    return target, drafter


def fill(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int32:
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen)
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def write_checkpoint(root: Path, target_cfg: dict, drafter_cfg: dict) -> int:
    """Writes both checkpoints a file at a time (never more than one file's tensors in memory); returns bytes."""
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, target_cfg.get("torch_dtype", "float32"))
    total = 0
    for name, hf, specs in (
        ("target", target_cfg, hf_target_specs(TargetConfig.from_hf(target_cfg), include_experts=False)),
        ("drafter", drafter_cfg, hf_drafter_specs(DrafterConfig.from_hf(drafter_cfg))),
    ):
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(hf, indent=2))
        groups: dict[str, dict] = {}
        for tensor_name, spec in specs.items():
            key = tensor_name.split(".")[2] if tensor_name.startswith("model.layers.") else "rest"
            groups.setdefault(key, {})[tensor_name] = fill(spec.shape, dtype, gen)
        for key, tensors in groups.items():
            save_file(tensors, str(out / f"model-{key}.safetensors"))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    cfg = TargetConfig.from_hf(target_cfg)
    hidden, width = cfg.hidden_size, cfg.moe_intermediate_size
    group = cfg.quantization.group_size
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(layer):
            continue
        for first in range(0, cfg.n_routed_experts, EXPERTS_PER_FILE):
            tensors = {}
            for e in range(first, min(first + EXPERTS_PER_FILE, cfg.n_routed_experts)):
                for proj, (rows, cols) in (("gate_proj", (width, hidden)), ("up_proj", (width, hidden)),
                                           ("down_proj", (hidden, width))):  # fmt: skip
                    base = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                    tensors[f"{base}.weight_packed"] = fill((rows, cols // 8), torch.int32, gen)
                    tensors[f"{base}.weight_scale"] = (torch.rand(rows, cols // group, generator=gen) * 1e-3).to(
                        torch.bfloat16
                    )
                    tensors[f"{base}.weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
            save_file(tensors, str(root / "target" / f"model-experts-{layer}-{first:03d}.safetensors"))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    return total


class MemorySampler(threading.Thread):
    """Peak VmRSS / RssAnon / RssFile of one process, from /proc every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak = pid, interval, {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.done = threading.Event()

    def run(self) -> None:
        path = Path(f"/proc/{self.pid}/status")
        while not self.done.is_set():
            try:
                for line in path.read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in self.peak:
                        self.peak[key] = max(self.peak[key], int(value.split()[0]) * 1024)
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(self.interval)


def convert_once(root: Path, tp_size: int, max_shard_size: str) -> dict:
    out = root / "converted"
    shutil.rmtree(out, ignore_errors=True)  # a --force convert stages beside the old output: twice the disk
    command = [sys.executable, "-m", "builder.cli", "convert", "--model_dir", str(root / "target"),
               "--draft_model_dir", str(root / "drafter"), "--output_dir", str(out), "--tp_size", str(tp_size),
               "--max_shard_size", max_shard_size, "--force"]  # fmt: skip
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = MemorySampler(process.pid)
    sampler.start()
    log, _ = process.communicate()
    seconds = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"convert failed:\n{log[-3000:]}")
    written = sum(p.stat().st_size for p in out.rglob("*.safetensors"))
    files = len(list(out.rglob("*.safetensors")))
    lines = [line for line in log.splitlines() if line.startswith("[build-engine]")]
    return {"seconds": seconds, "peak": sampler.peak, "written_bytes": written, "files": files, "log": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--moe_layers", type=int, default=2)
    parser.add_argument("--tp_size", type=int, default=8)
    parser.add_argument("--max_shard_size", default="1GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="the tiny model's dimensions: checks the script")
    args = parser.parse_args()
    target_cfg, drafter_cfg = kimi_configs(args.moe_layers, args.smoke)
    start = time.perf_counter()
    stamp = args.workdir / "source.json"
    made = {"target": target_cfg, "drafter": drafter_cfg}
    if stamp.is_file() and json.loads(stamp.read_text())["configs"] == made:
        source = json.loads(stamp.read_text())["bytes"]  # the same synthetic checkpoint, written before
    else:
        shutil.rmtree(args.workdir, ignore_errors=True)
        source = write_checkpoint(args.workdir, target_cfg, drafter_cfg)
        stamp.write_text(json.dumps({"configs": made, "bytes": source}))
    print(f"synthetic checkpoint: {source / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s", flush=True)
    cfg = TargetConfig.from_hf(target_cfg)
    group = cfg.quantization.group_size
    moe_layer = 3 * cfg.n_routed_experts * cfg.hidden_size * cfg.moe_intermediate_size * (4 + 16 / group) / 8
    runs = []
    for i in range(args.repeats):
        runs.append(convert_once(args.workdir, args.tp_size, args.max_shard_size))
        print(f"run {i}: {runs[-1]['seconds']:.1f} s, peak {runs[-1]['peak']}", flush=True)
    seconds = statistics.median(r["seconds"] for r in runs)
    result = {
        "environment": {
            **environment(smoke=True),
            "gpu": None,
            "cpu_cores": len(os.sched_getaffinity(0)),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        },  # fmt: skip
        "command": " ".join(sys.argv),
        "model": {
            "layers": cfg.num_hidden_layers,
            "moe_layers": args.moe_layers,
            "hidden": cfg.hidden_size,
            "experts": cfg.n_routed_experts,
            "expert_width": cfg.moe_intermediate_size,
            "vocab": cfg.vocab_size,
            "one_moe_layer_packed_bytes": moe_layer,
        },  # fmt: skip
        "tp_size": args.tp_size,
        "max_shard_size": args.max_shard_size,
        "source_bytes": source,
        "median_seconds": seconds,
        "read_gb_per_s": source / seconds / 1e9,
        "peak_rss_bytes": max(r["peak"]["VmRSS"] for r in runs),
        "peak_anon_bytes": max(r["peak"]["RssAnon"] for r in runs),
        "peak_file_bytes": max(r["peak"]["RssFile"] for r in runs),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
