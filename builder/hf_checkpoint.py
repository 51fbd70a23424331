"""Reading Hugging Face checkpoints: Kimi K2.x target (plain or K2.5/K2.6 multimodal wrapper) and DFlash drafter.

Tensors are read lazily, one at a time, through safetensors' `safe_open`, so a converter never holds more than
the tensors it is working on. INT4 `pack-quantized` weights are read packed or dequantized.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from safetensors import safe_open

from builder import int4
from models.config import WRAPPER_MODEL_TYPES, DrafterConfig, QuantConfig, TargetConfig

log = logging.getLogger("ddtree.builder")

LANGUAGE_MODEL_PREFIX = "language_model."


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {model_dir} has no config.json (expected {path})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


class SafetensorsDir:
    """All `*.safetensors` files of a directory, indexed by tensor name."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"checkpoint {model_dir} has no *.safetensors files")
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        self._handles = {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as err:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"{file} is not a readable safetensors file: {err}") from err
            self._handles[file] = handle
            for name in handle.keys():
                self._where[name] = file
                view = handle.get_slice(name)
                self._shapes[name] = tuple(view.get_shape())
                self._dtypes[name] = view.get_dtype()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def nbytes(self, name: str) -> int:
        """Stored bytes of one tensor (from the header: nothing is read)."""
        size = _DTYPE_BYTES[self._dtypes[name].upper()]
        return size * math.prod(self._shapes[name])

    def get(self, name: str) -> torch.Tensor:
        tensor = self._handles[self._where[name]].get_tensor(name)
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"tensor {name} in {self._where[name]} holds NaN or Inf values; weights must be finite")
        return tensor


class TargetCheckpoint:
    """A Kimi K2.x target checkpoint with canonical (text-model) tensor names; `get` dequantizes INT4 weights,
    `get_int4` returns them as stored."""

    def __init__(self, model_dir: Path):
        raw = read_config(model_dir)
        self.prefix = ""
        if raw.get("model_type") in WRAPPER_MODEL_TYPES or "text_config" in raw:
            if "text_config" not in raw:
                raise ValueError(f"{raw.get('model_type')} checkpoint {model_dir} has no text_config")
            log.info(
                "multimodal wrapper %s: using text_config and %s* tensors", raw.get("model_type"), LANGUAGE_MODEL_PREFIX
            )
            text = dict(raw["text_config"])
            text.setdefault("quantization_config", raw.get("quantization_config"))
            raw, self.prefix = text, LANGUAGE_MODEL_PREFIX
        self.hf_config = raw
        self.config = TargetConfig.from_hf(raw)
        self.dtype = _torch_dtype(raw)
        self.files = SafetensorsDir(model_dir)
        self.quant: QuantConfig | None = self.config.quantization
        self._names = self._canonical_names()

    def _canonical_names(self) -> dict[str, str]:
        """canonical name -> stored name; an INT4 triplet collapses into one `...weight` entry (stored: its base)."""
        names, ignored = {}, []
        self._quantized: set[str] = set()
        for stored in self.files.shapes():
            if not stored.startswith(self.prefix):
                ignored.append(stored)
                continue
            name = stored[len(self.prefix) :]
            if self.quant and name.endswith(_INT4_SUFFIXES):
                name = name.rsplit(".", 1)[0] + ".weight"
                stored = stored.rsplit(".", 1)[0]
                self._quantized.add(name)
            names[name] = stored
        if ignored:
            log.info(
                "ignoring %d non-language-model tensors (vision tower, projector), e.g. %s", len(ignored), ignored[0]
            )
        return names

    def shapes(self) -> dict[str, tuple[int, ...]]:
        raw = self.files.shapes()
        return {
            name: self._int4_shape(stored) if name in self._quantized else raw[stored]
            for name, stored in self._names.items()
        }

    def _int4_shape(self, base: str) -> tuple[int, ...]:
        for suffix in _INT4_SUFFIXES:
            if base + suffix not in self.files:
                raise ValueError(f"INT4 tensor {base} is missing {base}{suffix}")
        return tuple(int(v) for v in self.files.get(base + ".weight_shape"))

    def nbytes(self, name: str) -> int:
        stored = self._names[name]
        if name not in self._quantized:
            return self.files.nbytes(stored)
        return sum(self.files.nbytes(stored + suffix) for suffix in _INT4_SUFFIXES)

    def is_int4(self, name: str) -> bool:
        return name in self._quantized

    def get_int4(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """An INT4 weight as stored: (weight_packed [out, in / 8] int32, weight_scale [out, in / group_size])."""
        stored = self._names[name]
        out_features, in_features = self._int4_shape(stored)
        packed, scale = self.files.get(stored + ".weight_packed"), self.files.get(stored + ".weight_scale")
        group = self.quant.group_size
        if packed.dtype != torch.int32 or tuple(packed.shape) != (out_features, -(-in_features // 8)):
            raise ValueError(
                f"{stored}.weight_packed must be int32 {(out_features, -(-in_features // 8))} for weight_shape "
                f"{(out_features, in_features)}, got {packed.dtype} {tuple(packed.shape)}"
            )
        if tuple(scale.shape) != (out_features, in_features // group):
            raise ValueError(
                f"{stored}.weight_scale must be {(out_features, in_features // group)} (group_size={group}), "
                f"got {tuple(scale.shape)}"
            )
        return packed, scale

    def get(self, name: str) -> torch.Tensor:
        stored = self._names[name]
        if name not in self._quantized:
            return self.files.get(stored)
        shape = self._int4_shape(stored)
        return int4.dequantize(
            self.files.get(stored + ".weight_packed"),
            self.files.get(stored + ".weight_scale"),
            shape,
            self.quant.group_size,
        )


_INT4_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_DTYPE_BYTES.update({"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1})


class DrafterCheckpoint:
    """A DFlash drafter checkpoint: only `layers.*`, `fc`, `hidden_norm`, `norm` (optional `model.` prefix)."""

    def __init__(self, model_dir: Path):
        self.hf_config = read_config(model_dir)
        self.config = DrafterConfig.from_hf(self.hf_config)
        self.dtype = _torch_dtype(self.hf_config)
        self.files = SafetensorsDir(model_dir)
        self._names = {s.removeprefix("model."): s for s in self.files.shapes()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        raw = self.files.shapes()
        return {name: raw[stored] for name, stored in self._names.items()}

    def nbytes(self, name: str) -> int:
        return self.files.nbytes(self._names[name])

    def get(self, name: str) -> torch.Tensor:
        return self.files.get(self._names[name])


def _torch_dtype(config: dict) -> str:
    return str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
