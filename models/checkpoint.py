"""The converted TP-N checkpoint directory (TensorRT-LLM style), written by `build-engine convert`.

ckpt/
  config.json                      architecture, dtype, mapping, target and drafter configs
  target/rank{N}.safetensors       one rank's target weights (experts stacked per layer; INT4 ones kept packed),
                                   or, when convert wrote several shards, rank{N}-00001-of-0000M.safetensors ...
                                   and rank{N}.safetensors.index.json (HF's sharded-checkpoint index)
  drafter/rank{N}.safetensors      one rank's drafter weights (only its own tensors), sharded the same way
  tokenizer/                       the target's tokenizer files, copied
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from models.config import DrafterConfig, TargetConfig
from models.layout import check_tensor_set, rank_drafter_shapes, rank_target_shapes
from models.mapping import Mapping

CHECKPOINT_SCHEMA = 1
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CheckpointConfig:
    target: TargetConfig
    drafter: DrafterConfig
    dtype: str
    tp_size: int
    source_quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        self.drafter.check_against(self.target)

    def to_dict(self) -> dict:
        return {
            "schema_version": CHECKPOINT_SCHEMA,
            "architecture": "DeepseekV3ForCausalLM",
            "drafter_architecture": "DFlashDraftModel",
            "dtype": self.dtype,
            "mapping": Mapping(self.tp_size, 0, self.tp_size).to_dict(),
            "source_quantization": self.source_quantization,
            "quantization": self.quantization(),
            "target": self.target.to_dict(),
            "drafter": self.drafter.to_dict(),
        }

    def quantization(self) -> dict | None:
        """What is quantized in this checkpoint, in TensorRT-LLM's quant_config terms (None: nothing)."""
        quant = self.target.quantization
        if quant is None:
            return None
        return {
            "quant_algo": "W4A16",
            "group_size": quant.group_size,
            "has_zero_point": False,
            "format": "compressed-tensors pack-quantized: int32 words of 8 int4 values (value + 8), group scales",
            "quantized_tensors": "model.layers.*.mlp.experts.{gate,up,down}_proj.weight_{packed,scale}",
        }

    @classmethod
    def from_dict(cls, data: dict, where: str) -> CheckpointConfig:
        if data.get("schema_version") != CHECKPOINT_SCHEMA:
            raise ValueError(f"{where}: schema_version must be {CHECKPOINT_SCHEMA}, got {data.get('schema_version')}")
        tp = int(data["mapping"]["tp_size"])
        mapping = Mapping(tp, 0, tp)
        return cls(
            target=TargetConfig.from_dict(data["target"], mapping),
            drafter=DrafterConfig.from_dict(data["drafter"], mapping),
            dtype=data["dtype"],
            tp_size=tp,
            source_quantization=data.get("source_quantization"),
        )

    def rank_configs(self, rank: int) -> tuple[TargetConfig, DrafterConfig]:
        mapping = Mapping(self.tp_size, rank, self.tp_size)
        return self.target.for_rank(mapping), self.drafter.for_rank(mapping)


def rank_file(root: Path, role: str, rank: int) -> Path:
    return Path(root) / role / f"rank{rank}.safetensors"


def index_file(root: Path, role: str, rank: int) -> Path:
    return Path(root) / role / f"rank{rank}.safetensors.index.json"


def rank_files(root: Path, role: str, rank: int, tp_size: int) -> dict[Path, list[str] | None]:
    """One rank's safetensors files -> the tensors the index says each holds (None: a single file, all of them)."""
    root = Path(root)
    index = index_file(root, role, rank)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index} is not a safetensors index with a weight_map: {err}") from err
        files: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(index.parent / file, []).append(name)
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint_dir {root} lacks {path.relative_to(root)}, listed in {index.name}")
        return files
    single = rank_file(root, role, rank)
    if not single.is_file():
        raise FileNotFoundError(
            f"checkpoint_dir {root} lacks {single.relative_to(root)} (or {index.relative_to(root)}) (tp_size={tp_size})"
        )
    return {single: None}


def load_checkpoint_config(root: Path) -> CheckpointConfig:
    path = Path(root) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint_dir {root} has no config.json; run `build-engine convert` first")
    return CheckpointConfig.from_dict(json.loads(path.read_text()), str(path))


def load_rank_weights(root: Path, rank: int) -> tuple[CheckpointConfig, dict, dict]:
    """One rank's (config, target tensors, drafter tensors), names and shapes checked against the config."""
    from safetensors.torch import load_file

    config = load_checkpoint_config(root)
    if not 0 <= rank < config.tp_size:
        raise ValueError(f"rank must be in [0, tp_size={config.tp_size}), got {rank}")
    target_cfg, drafter_cfg = config.rank_configs(rank)
    tensors = {}
    for role, expected in (("target", rank_target_shapes(target_cfg)), ("drafter", rank_drafter_shapes(drafter_cfg))):
        tensors[role] = {}
        for path, names in rank_files(root, role, rank, config.tp_size).items():
            loaded = load_file(str(path))
            if names is not None and sorted(loaded) != sorted(names):
                raise ValueError(f"{path} holds {len(loaded)} tensors, its index lists {len(names)} others")
            tensors[role].update(loaded)
        where = f"{Path(root) / role} rank {rank}"
        check_tensor_set({k: tuple(v.shape) for k, v in tensors[role].items()}, expected, where)
    return config, tensors["target"], tensors["drafter"]
