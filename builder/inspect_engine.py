"""`build-engine inspect ENGINE_DIR`: per rank and role, the profiles with their bounds, the plugin layers and
their fields, engine sizes, and the builder that made them.

TensorRT-RTX cannot deserialize an engine without a GPU, so the profiles and plugin layers come from the builder's
own record (`{role}.build.json`: what `IOptimizationProfile.get_shape` returned and which layers the parser made
PLUGIN_V3), and the plan bytes are checked to carry each plugin's name.
"""

from __future__ import annotations

from pathlib import Path

from engines.engine_dir import load_engine_dir
from engines.io import ROLES


def _bounds(shapes: list[list[int]]) -> str:
    low, opt, high = shapes
    return str(low) if low == high else f"{low}..{high} (opt {opt})"


def inspect_engine_dir(path: Path) -> str:
    engine = load_engine_dir(path)
    config = engine.config
    spec, build = config["spec"], config["build_config"]
    lines = [
        f"engine dir: {engine.path}",
        f"  built by {config['engines']['builder']} {config['engines']['builder_version']} "
        f"(ddtree-trt {config['version']}), tp_size={engine.tp_size}, dtype={build['dtype']}",
        f"  spec: block_size={spec['block_size']} budget={spec['budget']} max_topk={spec['max_topk']}; "
        f"limits: max_input_len={build['max_input_len']} max_seq_len={build['max_seq_len']} "
        f"max_batch_size={build['max_batch_size']}",
    ]
    for rank in range(engine.tp_size):
        for role in ROLES:
            info = engine.build_info(rank, role)
            plan = engine.engine_path(rank, role)
            if config["engines"]["builder"] == "none":
                lines.append(f"  rank{rank}/{role}: ONNX only (built with --no_tensorrt)")
                continue
            if not info or not plan.is_file():
                lines.append(f"  rank{rank}/{role}: NO ENGINE (missing {plan.name} or its build record)")
                continue
            data = plan.read_bytes()
            lines.append(
                f"  rank{rank}/{role}.engine: {len(data) / 1e6:.2f} MB, {info['layers']} layers, "
                f"built in {info['build_seconds']} s"
            )
            for name, profile in info["profiles"].items():
                dims = ", ".join(f"{t}={_bounds(s)}" for t, s in profile["shapes"].items() if t != "latent_cache")
                lines.append(f"    profile {profile['index']} {name}: {dims}")
            counts: dict[str, int] = {}
            for plugin in info["plugins"]:
                counts[plugin["op"]] = counts.get(plugin["op"], 0) + 1
            for op, count in counts.items():
                fields = sorted({str(p["fields"]) for p in info["plugins"] if p["op"] == op})
                recorded = "recorded in plan" if op.encode() in data else "NOT FOUND IN PLAN"
                lines.append(f"    plugin ddtree::{op} x{count} ({recorded}); fields: {'; '.join(fields)}")
    return "\n".join(lines)
