"""Per-rank torch modules -> one ONNX graph per rank and role, custom ops in the `ddtree` domain.

Every dynamic dimension is named after its profile dimension (`tokens`, `logits`, `context`, `block`,
`cache_capacity`), so no size is baked into a graph: the same file runs at every size its profiles admit.
Weights go to an external data file next to the graph (`target.onnx` + `target.onnx.data`).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from engines.io import TensorIO, role_io
from engines.spec import Profile
from models.loader import load_rank_models
from models.ops import ModelOps
from plugins.collectives.onnx_op import ExportCollectives
from plugins.int4_moe.onnx_op import export_int4_moe
from plugins.tree_attention.onnx_op import export_tree_attention

log = logging.getLogger("ddtree.builder")

OPSET = 18
TRACE_PROFILE = {"target": "verify_chain", "draft": "draft"}


def example_feeds(inputs: list[TensorIO], profile: Profile, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Valid inputs at the profile's opt shapes (values matter only for tracing)."""
    gen = torch.Generator().manual_seed(0)
    feeds = []
    for tensor in inputs:
        shape = tensor.shape_range(profile)[1]
        if tensor.dtype == "bool":
            feeds.append(torch.ones(shape, dtype=torch.bool).tril())
        elif tensor.dtype == "int64":
            feeds.append(torch.arange(int(np.prod(shape)), dtype=torch.int64).reshape(shape) % 4)
        else:
            feeds.append(torch.randn(shape, generator=gen).to(dtype))
    return tuple(feeds)


def dynamic_axes(tensors: list[TensorIO]) -> dict[str, dict[int, str]]:
    return {t.name: {i: d for i, d in enumerate(t.dims) if isinstance(d, str)} for t in tensors}


def export_rank(checkpoint_dir: Path, rank: int, profiles: dict[str, Profile], out_dir: Path) -> dict[str, Path]:
    """Writes out_dir/{target,draft}.onnx (+ .onnx.data) for one rank; returns the graph paths."""
    import onnx

    from models.checkpoint import load_checkpoint_config
    from models.moe import moe_form

    checkpoint = load_checkpoint_config(checkpoint_dir)
    moe = moe_form(checkpoint.rank_configs(rank)[0])  # the CPU form: TensorRT and ONNX Runtime run these graphs
    ops = ModelOps(export_tree_attention, ExportCollectives(checkpoint.tp_size), moe=moe, int4_moe=export_int4_moe)
    config, target, drafter = load_rank_models(checkpoint_dir, rank, ops)
    target_cfg, drafter_cfg = config.rank_configs(rank)
    dtype = next(target.parameters()).dtype
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for role, module in (("target", target), ("draft", drafter)):
        inputs, outputs = role_io(role, target_cfg, drafter_cfg)
        path = out_dir / f"{role}.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
            torch.onnx.export(
                module,
                example_feeds(inputs, profiles[TRACE_PROFILE[role]], dtype),
                str(path),
                dynamo=False,
                opset_version=OPSET,
                input_names=[t.name for t in inputs],
                output_names=[t.name for t in outputs],
                dynamic_axes=dynamic_axes(inputs + outputs),
                custom_opsets={"ddtree": 1},
                do_constant_folding=True,
            )
        model = onnx.load(str(path))
        data = path.with_suffix(".onnx.data")
        data.unlink(missing_ok=True)  # onnx appends to an existing data file
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data.name,
            size_threshold=0,
        )
        check_graph(path, inputs, outputs)
        paths[role] = path
        log.info("rank %d %s: %s (%d nodes)", rank, role, path, len(model.graph.node))
    return paths


def check_graph(path: Path, inputs: list[TensorIO], outputs: list[TensorIO]) -> None:
    """The graph's I/O names and named dims are exactly the contract's (nothing baked in)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph

    def dims(value):
        return tuple(d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim)

    found = {v.name: dims(v) for v in list(graph.input) + list(graph.output)}
    for tensor in inputs + outputs:
        if tensor.name not in found:
            raise RuntimeError(f"{path}: exported graph lacks {tensor.name}")
        got = found[tensor.name]
        if len(got) != len(tensor.dims) or any(isinstance(d, str) and g != d for d, g in zip(tensor.dims, got)):
            raise RuntimeError(f"{path}: {tensor.name} has dims {list(got)}, expected {list(tensor.dims)}")


def custom_ops(path: Path) -> list[tuple[str, str, dict]]:
    """(node name, op type, attributes) of every ddtree-domain node."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return [
        (node.name, node.op_type, {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute})
        for node in graph.node
        if node.domain == "ddtree"
    ]
