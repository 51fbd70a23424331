"""Engine inputs and outputs by role: names, dtypes and dims (named dims are the profiles' dims).

The same table drives the ONNX export (input/output names, dynamic axes), the TensorRT build (profile shapes),
and every runtime session's shape check, so a tensor cannot be fed at a size its profile does not admit.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.spec import Profile
from models.config import DrafterConfig, TargetConfig

Dim = int | str
ROLES = ("target", "draft")  # the two engines of a rank: the Kimi target and the DFlash drafter


@dataclass(frozen=True)
class TensorIO:
    name: str
    dtype: str  # "int64", "bool", or "model" (the checkpoint dtype) / "float32"
    dims: tuple[Dim, ...]

    def shape_range(self, profile: Profile) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(min, opt, max) shapes of this tensor under `profile`."""
        picks = [[], [], []]
        for dim in self.dims:
            bounds = profile.dims[dim] if isinstance(dim, str) else (dim, dim, dim)
            for i in range(3):
                picks[i].append(bounds[i])
        return tuple(picks[0]), tuple(picks[1]), tuple(picks[2])


def target_io(target: TargetConfig, drafter: DrafterConfig) -> tuple[list[TensorIO], list[TensorIO]]:
    layers, latent = target.num_hidden_layers, target.latent_dim
    inputs = [
        TensorIO("input_ids", "int64", ("tokens",)),
        TensorIO("positions", "int64", ("tokens",)),
        TensorIO("tree_mask", "bool", ("tokens", "tokens")),
        TensorIO("latent_cache", "model", (layers, "cache_capacity", latent)),
        TensorIO("cache_length", "int64", (1,)),
        TensorIO("logit_indices", "int64", ("logits",)),
    ]
    outputs = [
        TensorIO("logits", "float32", ("logits", target.vocab_size)),
        TensorIO("new_latent_kv", "model", (layers, "tokens", latent)),
        TensorIO("taps", "model", ("tokens", drafter.num_taps * target.hidden_size)),
    ]
    return inputs, outputs


def draft_io(target: TargetConfig, drafter: DrafterConfig) -> tuple[list[TensorIO], list[TensorIO]]:
    cache = (drafter.num_hidden_layers, 2, "cache_capacity", drafter.kv_heads_per_rank, drafter.head_dim)
    inputs = [
        TensorIO("context_hidden", "model", ("context", drafter.num_taps * target.hidden_size)),
        TensorIO("context_positions", "int64", ("context",)),
        TensorIO("context_length", "int64", (1,)),
        TensorIO("block_ids", "int64", ("block",)),
        TensorIO("block_positions", "int64", ("block",)),
        TensorIO("draft_cache", "model", cache),
        TensorIO("draft_cache_length", "int64", (1,)),
    ]
    outputs = [
        TensorIO("draft_logits", "float32", ("draft_rows", target.vocab_size)),
        TensorIO(
            "new_context_kv",
            "model",
            (drafter.num_hidden_layers, 2, "context", drafter.kv_heads_per_rank, drafter.head_dim),
        ),
    ]
    return inputs, outputs


def role_io(role: str, target: TargetConfig, drafter: DrafterConfig) -> tuple[list[TensorIO], list[TensorIO]]:
    if role == "target":
        return target_io(target, drafter)
    if role == "draft":
        return draft_io(target, drafter)
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def engine_io(target: TargetConfig, drafter: DrafterConfig) -> dict[str, tuple[list[TensorIO], list[TensorIO]]]:
    """Inputs and outputs of both engines of a rank, by role."""
    return {role: role_io(role, target, drafter) for role in ROLES}


def check_feeds(profile: Profile, inputs: list[TensorIO], shapes: dict[str, tuple[int, ...]]) -> None:
    """Raises naming profile, tensor, expected and got when a feed does not fit the profile."""
    missing = [t.name for t in inputs if t.name not in shapes]
    if missing:
        raise ValueError(f"profile {profile.name}: missing inputs {missing}")
    seen: dict[str, int] = {}
    for tensor in inputs:
        got = tuple(shapes[tensor.name])
        low, _, high = tensor.shape_range(profile)
        fits = len(got) == len(low) and all(lo <= g <= hi for g, lo, hi in zip(got, low, high))
        for dim, size in zip(tensor.dims, got):
            if isinstance(dim, str) and seen.setdefault(dim, size) != size:
                fits = False
        if not fits:
            expected = [f"{lo}" if lo == hi else f"{lo}..{hi}" for lo, hi in zip(low, high)]
            raise ValueError(
                f"profile {profile.name}: input {tensor.name} expected shape [{', '.join(expected)}] "
                f"(dims {list(tensor.dims)}, consistent across inputs), got {list(got)}"
            )
