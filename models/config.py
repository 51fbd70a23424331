"""Frozen, validated configurations of the Kimi K2.x target and the DFlash drafter.

Both are read from Hugging Face `config.json` dicts (`from_hf`) and written back in the converted checkpoint
(`to_dict` / `from_dict`). Every structural rule the runtime relies on is checked once, here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from models.mapping import Mapping, check_divides

TARGET_MODEL_TYPES = ("kimi_k2", "deepseek_v3")
WRAPPER_MODEL_TYPES = ("kimi_k25", "kimi_k26")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters in transformers' `rope_parameters` vocabulary ('default' or 'yarn')."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_scaling type must be 'default' or 'yarn', got {self.rope_type!r}")
        if self.rope_type == "yarn" and not self.original_max_position_embeddings:
            raise ValueError("yarn rope_scaling needs original_max_position_embeddings, got none")

    @classmethod
    def from_hf(cls, config: dict) -> RopeConfig:
        """Reads legacy `rope_theta` + `rope_scaling` or transformers-5 `rope_parameters`."""
        params = dict(config.get("rope_parameters") or {})
        params.update(config.get("rope_scaling") or {})
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return cls(theta=float(theta))
        return cls(
            rope_type=rope_type,
            theta=float(theta),
            factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )

    def to_hf(self) -> dict:
        if self.rope_type == "default":
            return {"rope_theta": self.theta}
        scaling = {
            "type": "yarn",
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "mscale": self.mscale,
            "mscale_all_dim": self.mscale_all_dim,
        }
        if self.attention_factor is not None:
            scaling["attention_factor"] = self.attention_factor
        return {"rope_theta": self.theta, "rope_scaling": scaling}


def check_field_types(config, what: str) -> None:
    """Every `int` field holds an int (not a bool, not 64.0) and every `float` field a finite number: a config.json
    with a value of the wrong type is an error that names it, not a traceback from a shape computation later."""
    for f in fields(config):
        value = getattr(config, f.name)
        if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{what} {f.name} must be an integer, got {value!r} ({type(value).__name__})")
        if f.type == "float" and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        ):
            raise ValueError(f"{what} {f.name} must be a finite number, got {value!r} ({type(value).__name__})")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class QuantConfig:
    """compressed-tensors `pack-quantized` INT4 weight-only quantization of the routed experts."""

    num_bits: int = 4
    group_size: int = 32
    ignore: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, quant: dict) -> QuantConfig:
        method, fmt = quant.get("quant_method"), quant.get("format")
        if method != "compressed-tensors" or fmt != "pack-quantized":
            raise ValueError(
                "quantization_config must be compressed-tensors / pack-quantized (INT4 routed experts), "
                f"got quant_method={method!r} format={fmt!r}"
            )
        groups = list((quant.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"quantization_config needs exactly one config group, got {len(groups)}")
        weights = groups[0].get("weights") or {}
        expected = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        for key, value in expected.items():
            if weights.get(key) != value:
                raise ValueError(f"quantization weights.{key} must be {value!r}, got {weights.get(key)!r}")
        if groups[0].get("input_activations") is not None:
            raise ValueError("quantization with input_activations (W4A8 etc.) is not supported; only W4A16")
        return cls(num_bits=4, group_size=int(weights["group_size"]), ignore=tuple(quant.get("ignore") or ()))


@dataclass(frozen=True)
class TargetConfig:
    """Kimi K2.x text model (DeepSeek-V3 architecture: MLA + noaux_tc sigmoid-routed MoE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    rope: RopeConfig
    max_position_embeddings: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_interleave: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    model_type: str = "kimi_k2"
    quantization: QuantConfig | None = None
    mapping: Mapping = field(default_factory=Mapping)

    def __post_init__(self) -> None:
        check_field_types(self, "target config")
        if self.model_type not in TARGET_MODEL_TYPES:
            raise ValueError(f"model_type must be one of {TARGET_MODEL_TYPES}, got {self.model_type!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace must be in [0, num_hidden_layers={self.num_hidden_layers}], "
                f"got {self.first_k_dense_replace}"
            )
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts}")
        reachable = self.n_routed_experts // self.n_group * self.topk_group
        if self.num_experts_per_tok > reachable:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts reachable through "
                f"topk_group={self.topk_group} of n_group={self.n_group} groups ({reachable})"
            )
        tp = self.mapping.tp_size
        check_divides(tp, self.num_attention_heads, "num_attention_heads")
        check_divides(tp, self.moe_intermediate_size, "moe_intermediate_size (each expert's width)")
        check_divides(tp, self.intermediate_size, "intermediate_size (dense MLP width)")
        check_divides(tp, self.vocab_size, "vocab_size")

    # Derived values ------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent KV row: kv_lora_rank (c_kv) + qk_rope_head_dim (k_pe); 576 for Kimi."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """DeepSeek YaRN semantics: qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2."""
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type == "yarn" and self.rope.mscale_all_dim:
            scale *= yarn_mscale(self.rope.factor, self.rope.mscale_all_dim) ** 2
        return scale

    @property
    def heads_per_rank(self) -> int:
        return self.num_attention_heads // self.mapping.tp_size

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def for_rank(self, mapping: Mapping) -> TargetConfig:
        return replace(self, mapping=mapping)

    # (De)serialisation ---------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: dict, mapping: Mapping | None = None) -> TargetConfig:
        """Builds from a Kimi K2.x / DeepSeek-V3 `config.json` dict (text config, not the multimodal wrapper)."""
        model_type = config.get("model_type")
        if model_type not in TARGET_MODEL_TYPES:
            raise ValueError(
                f"unsupported target model_type {model_type!r}; expected one of {TARGET_MODEL_TYPES} "
                f"(or a {WRAPPER_MODEL_TYPES} wrapper with text_config)"
            )
        if config.get("q_lora_rank") is None:
            raise ValueError("q_lora_rank must be set (Kimi K2.x uses 1536); q_lora_rank=None is not supported")
        if config.get("scoring_func", "sigmoid") != "sigmoid" or config.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(
                "routing must be topk_method='noaux_tc' with scoring_func='sigmoid', got "
                f"{config.get('topk_method')!r}/{config.get('scoring_func')!r}"
            )
        if config.get("moe_layer_freq", 1) != 1:
            raise ValueError(f"moe_layer_freq must be 1, got {config.get('moe_layer_freq')}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {config.get('hidden_act')!r}")
        required = [f for f in _TARGET_FIELDS if f not in config]
        if required:
            raise ValueError(f"target config.json is missing fields: {sorted(required)}")
        quant = config.get("quantization_config")
        eos = config.get("eos_token_id")
        return cls(
            **{f: config[f] for f in _TARGET_FIELDS},
            n_group=config.get("n_group") or 1,
            topk_group=config.get("topk_group") or 1,
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(config),
            rope_interleave=bool(config.get("rope_interleave", True)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            pad_token_id=config.get("pad_token_id"),
            model_type=model_type,
            quantization=QuantConfig.from_hf(quant) if quant else None,
            mapping=mapping or Mapping(),
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("mapping")
        # a converted checkpoint keeps it only when its routed experts stayed INT4 (`models.moe.PackedMoE`)
        out["quantization"] = asdict(self.quantization) if self.quantization else None
        return out

    @classmethod
    def from_dict(cls, data: dict, mapping: Mapping) -> TargetConfig:
        data = dict(data)
        data["rope"] = RopeConfig(**data["rope"])
        quant = data.get("quantization")
        data["quantization"] = QuantConfig(**{**quant, "ignore": tuple(quant.get("ignore", ()))}) if quant else None
        return cls(**data, mapping=mapping)


_TARGET_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "first_k_dense_replace",
    "routed_scaling_factor",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class DrafterConfig:
    """DFlash block-diffusion drafter: Qwen3-style GQA layers fed with the target's tapped hidden states."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    mapping: Mapping = field(default_factory=Mapping)

    def __post_init__(self) -> None:
        check_field_types(self, "drafter config")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one bonus + at least one mask token), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be in [0, vocab_size={self.vocab_size}), got {self.mask_token_id}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer, got none")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        tp, kv = self.mapping.tp_size, self.num_key_value_heads
        check_divides(tp, self.num_attention_heads, "drafter num_attention_heads")
        if tp > kv and tp % kv:
            raise ValueError(
                f"tp_size={tp} must divide drafter num_key_value_heads={kv}, or be a multiple of it (each K/V head "
                f"then replicated on tp_size / num_key_value_heads ranks)"
            )
        if tp <= kv:
            check_divides(tp, kv, "drafter num_key_value_heads")
        check_divides(tp, self.intermediate_size, "drafter intermediate_size")
        check_divides(tp, self.vocab_size, "vocab_size")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def heads_per_rank(self) -> int:
        return self.num_attention_heads // self.mapping.tp_size

    @property
    def kv_heads_per_rank(self) -> int:
        """K/V heads a rank holds: its share, or one (replicated) when there are fewer heads than ranks."""
        return max(1, self.num_key_value_heads // self.mapping.tp_size)

    def for_rank(self, mapping: Mapping) -> DrafterConfig:
        return replace(self, mapping=mapping)

    def check_against(self, target: TargetConfig) -> None:
        """The drafter borrows the target's embedding, lm_head and hidden states: their shapes must agree."""
        if self.hidden_size != target.hidden_size:
            raise ValueError(
                f"drafter hidden_size={self.hidden_size} must equal the target's hidden_size={target.hidden_size}"
            )
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocab_size={self.vocab_size} must equal the target's={target.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ValueError(
                f"drafter target_layer_ids {list(self.target_layer_ids)} must lie in [0, "
                f"{target.num_hidden_layers}) (the target's num_hidden_layers); out of range: {bad}"
            )

    @classmethod
    def from_hf(cls, config: dict, mapping: Mapping | None = None) -> DrafterConfig:
        archs = config.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise ValueError(f"drafter architectures must include 'DFlashDraftModel', got {archs}")
        dflash = config.get("dflash_config") or {}

        def value(name, default=None):
            return dflash.get(name, config.get(name, default))

        layer_types = config.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"only full-attention drafter layers are supported, got layer_types={layer_types}")
        if value("target_layer_ids") is None or value("mask_token_id") is None:
            raise ValueError("drafter config needs dflash_config.target_layer_ids and mask_token_id")
        heads = config["num_attention_heads"]
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            block_size=int(value("block_size", 16)),
            mask_token_id=int(value("mask_token_id")),
            target_layer_ids=tuple(int(i) for i in value("target_layer_ids")),
            rope=RopeConfig.from_hf(config),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            mapping=mapping or Mapping(),
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("mapping")
        out["target_layer_ids"] = list(self.target_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict, mapping: Mapping) -> DrafterConfig:
        data = dict(data)
        data["rope"] = RopeConfig(**data["rope"])
        data["target_layer_ids"] = tuple(data["target_layer_ids"])
        return cls(**data, mapping=mapping)
