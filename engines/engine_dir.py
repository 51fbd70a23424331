"""The engine directory contract, written by `build-engine build` and read by every runtime.

ENGINE_DIR/
  config.json                 schema_version, version, pretrained_config (target, drafter, dtype, mapping),
                              spec, build_config, mapping, profiles (named, with their dims), engines (builder)
  rank{N}/target.onnx(.data)  the graphs the engines were built from (the `ort` backend runs them)
  rank{N}/draft.onnx(.data)
  rank{N}/target.engine       serialized TensorRT plans (the `trt` backend)
  rank{N}/draft.engine
  rank{N}/{role}.build.json   what the builder saw: profiles as set, plugin layers and fields, size, log
  checkpoint/                 the TP-N checkpoint (the `torch` backend builds its modules from it)
  tokenizer/                  the target's tokenizer
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engines.io import ROLES
from engines.spec import BuildConfig, Profile, SpecConfig

# 2: the graphs' and plans' Int4MoE nodes carry `rows` (the experts' word layout), which the ONNX Runtime op and the
# TensorRT plugin require; an engine directory of schema 1 lacks it and is refused with the rebuild advice below
ENGINE_SCHEMA = 2


@dataclass
class EngineDir:
    path: Path
    config: dict

    @property
    def tp_size(self) -> int:
        return int(self.config["mapping"]["tp_size"])

    @property
    def spec(self) -> SpecConfig:
        return SpecConfig(**self.config["spec"])

    @property
    def build_config(self) -> BuildConfig:
        return BuildConfig(**self.config["build_config"])

    @property
    def profiles(self) -> dict[str, Profile]:
        return {name: Profile.from_dict(name, data) for name, data in self.config["profiles"].items()}

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoint"

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    def rank_dir(self, rank: int) -> Path:
        return self.path / f"rank{rank}"

    def onnx_path(self, rank: int, role: str) -> Path:
        return self.rank_dir(rank) / f"{role}.onnx"

    def engine_path(self, rank: int, role: str) -> Path:
        return self.rank_dir(rank) / f"{role}.engine"

    def build_info(self, rank: int, role: str) -> dict:
        path = self.rank_dir(rank) / f"{role}.build.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.tp_size:
            raise ValueError(
                f"the engine in {self.path} was built for tp_size={self.tp_size}; this job has world size "
                f"{world_size} (run it with mpirun -np {self.tp_size})"
            )

    def check_files(self, backend: str) -> None:
        """Every file `backend` needs on every rank exists; the error names the first missing file."""
        needed = []
        for rank in range(self.tp_size):
            for role in ROLES:
                if backend == "ort":
                    needed += [self.onnx_path(rank, role)]
                elif backend == "trt":
                    needed += [self.engine_path(rank, role)]
        if backend == "torch":
            needed += [self.checkpoint_dir / "config.json"]
        missing = [p for p in needed if not p.is_file()]
        if missing:
            raise FileNotFoundError(
                f"engine directory {self.path} is incomplete for backend '{backend}': missing "
                f"{missing[0].relative_to(self.path)}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            )


def write_engine_dir_config(path: Path, version: str, pretrained_config: dict, spec: SpecConfig, build: BuildConfig,
                            profiles: dict[str, Profile], engines: dict) -> EngineDir:  # fmt: skip
    """Writes config.json, the last file of a build (a folder without it is an interrupted build), and loads it back
    through the reader below, so what is written is what every runtime reads."""
    config = {
        "schema_version": ENGINE_SCHEMA,
        "version": version,
        "pretrained_config": pretrained_config,
        "spec": spec.to_dict(),
        "build_config": build.to_dict(),
        "mapping": pretrained_config["mapping"],
        "profiles": {name: p.to_dict() for name, p in profiles.items()},
        "engines": engines,
    }
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return load_engine_dir(path)


def load_engine_dir(path: Path) -> EngineDir:
    path = Path(path)
    config_path = path / "config.json"
    if not path.is_dir():
        raise FileNotFoundError(f"engine directory {path} does not exist")
    if not config_path.is_file():
        raise FileNotFoundError(f"engine directory {path} has no config.json (was the build interrupted?)")
    config = json.loads(config_path.read_text())
    if config.get("schema_version") != ENGINE_SCHEMA:
        raise ValueError(
            f"{config_path}: schema_version {config.get('schema_version')} is not supported "
            f"(expected {ENGINE_SCHEMA}); rebuild the engines with this version of build-engine"
        )
    for key in ("pretrained_config", "spec", "build_config", "mapping", "profiles"):
        if key not in config:
            raise ValueError(f"{config_path} lacks '{key}'")
    return EngineDir(path=path, config=config)
