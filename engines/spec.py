"""One spec, all shapes: `SpecConfig` + `BuildConfig` derive every engine's named optimization profiles.

The draft forward always runs `block_size` tokens; tree verification runs `budget + 1` tokens. They are two
different numbers, so they get two different profiles, derived here and nowhere else:

    draft          block_size block tokens, block_size (padded) committed-context rows     [draft engine]
    draft_prefill  block_size block tokens, 1..max_input_len context rows (the prompt)     [draft engine]
    prefill        1..max_input_len tokens                                                 [target engine]
    decode         1 token (autoregressive baseline)                                       [target engine]
    verify_chain   block_size tokens (plain DFlash; also any tree with budget < block_size) [target engine]
    verify_tree    budget + 1 tokens (only when budget + 1 > block_size)                   [target engine]
    verify_tree_N  N = b + 1 tokens for each of `extra_budgets` b (b + 1 > block_size): more tree budgets the same
                   engines verify, chosen at run time (`--ddtree_budget b`)                [target engine]
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_BATCH_SIZE = 1


@dataclass(frozen=True)
class SpecConfig:
    """Speculation shape: a draft block of `block_size` tokens, a verified tree of `budget` nodes + the root."""

    block_size: int
    budget: int
    max_topk: int | None = None
    extra_budgets: tuple[int, ...] = ()  # more tree budgets the engines verify (a profile each), besides `budget`

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_budgets", tuple(int(b) for b in self.extra_budgets))
        bad = [b for b in self.extra_budgets if b < 1]
        if bad:
            raise ValueError(f"extra_budgets must be >= 1 tree node each, got {list(self.extra_budgets)}")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} must be >= 2 (the bonus token and >= 1 mask token)")
        if self.budget < 1:
            raise ValueError(f"budget={self.budget} must be >= 1 tree node")
        if self.max_topk is not None and self.max_topk < 1:
            raise ValueError(f"max_topk={self.max_topk} must be >= 1 (or None for no cap)")

    @property
    def draft_depth(self) -> int:
        """Deepest tree level: one per mask token of the block."""
        return self.block_size - 1

    def tree_width(self, vocab_size: int) -> int:
        """Candidates kept per depth: the budget, capped by max_topk and by the vocabulary."""
        return min(self.budget, self.max_topk or self.budget, vocab_size)

    @property
    def uses_tree_profile(self) -> bool:
        return self.budget + 1 > self.block_size

    @property
    def verify_profile(self) -> str:
        return "verify_tree" if self.uses_tree_profile else "verify_chain"

    @property
    def verify_tokens(self) -> int:
        """Rows of one verify forward: budget + 1, or block_size when the tree fits the chain profile."""
        return self.budget + 1 if self.uses_tree_profile else self.block_size

    @property
    def budgets(self) -> tuple[int, ...]:
        """Every tree budget the engines verify, ascending."""
        return tuple(sorted({self.budget, *self.extra_budgets}))

    def with_budget(self, budget: int) -> SpecConfig:
        """The runtime spec of one budget (the engines' other budgets are theirs, not the step's)."""
        return SpecConfig(self.block_size, budget, self.max_topk)

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "budget": self.budget, "max_topk": self.max_topk,
                "extra_budgets": list(self.extra_budgets)}  # fmt: skip


DEFAULT_PREFILL_CHUNK = 8192  # tokens one prefill forward takes at most at run time (SGLang's chunked prefill size)


@dataclass(frozen=True)
class BuildConfig:
    """Engine limits, in trtllm-build's vocabulary."""

    max_input_len: int = 256
    max_seq_len: int = 1024
    max_batch_size: int = 1
    max_num_tokens: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.max_batch_size != SUPPORTED_BATCH_SIZE:
            raise ValueError(
                f"max_batch_size={self.max_batch_size} is not supported; engines run one sequence per step "
                f"(max_batch_size={SUPPORTED_BATCH_SIZE}) and servers queue requests"
            )
        if not 1 <= self.max_input_len < self.max_seq_len:
            raise ValueError(f"max_input_len={self.max_input_len} must be in [1, max_seq_len={self.max_seq_len})")

    def to_dict(self) -> dict:
        return {
            "max_input_len": self.max_input_len,
            "max_seq_len": self.max_seq_len,
            "max_batch_size": self.max_batch_size,
            "max_num_tokens": self.max_num_tokens,
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class Profile:
    """A named optimization profile: the (min, opt, max) of every named dynamic dimension."""

    name: str
    role: str
    dims: dict[str, tuple[int, int, int]]

    def fixed(self, dim: str) -> int | None:
        low, _, high = self.dims[dim]
        return low if low == high else None

    def to_dict(self) -> dict:
        return {"role": self.role, "dims": {k: list(v) for k, v in self.dims.items()}}

    @classmethod
    def from_dict(cls, name: str, data: dict) -> Profile:
        return cls(name=name, role=data["role"], dims={k: tuple(v) for k, v in data["dims"].items()})


def _exact(n: int) -> tuple[int, int, int]:
    return (n, n, n)


def derive_profiles(spec: SpecConfig, build: BuildConfig) -> dict[str, Profile]:
    """Every profile of both engines. Raises if the build limits cannot hold the spec."""
    for budget in spec.budgets:
        need = spec.with_budget(budget)
        if build.max_num_tokens is not None and build.max_num_tokens < need.verify_tokens:
            raise ValueError(
                f"budget={budget} needs a {need.verify_tokens}-token {need.verify_profile} profile; "
                f"got max_num_tokens={build.max_num_tokens}"
            )
    if spec.block_size > build.max_input_len:
        raise ValueError(f"block_size={spec.block_size} must be <= max_input_len={build.max_input_len}")
    capacity = _exact(build.max_seq_len)
    prompt = (1, min(build.max_input_len, 64), build.max_input_len)
    block = _exact(spec.block_size)
    profiles = [
        Profile("draft", "draft", {"block": block, "context": block, "cache_capacity": capacity}),
        Profile("draft_prefill", "draft", {"block": block, "context": prompt, "cache_capacity": capacity}),
        Profile(
            "prefill", "target", {"tokens": prompt, "logits": (1, 1, build.max_input_len), "cache_capacity": capacity}
        ),
        Profile("decode", "target", {"tokens": _exact(1), "logits": _exact(1), "cache_capacity": capacity}),
        Profile("verify_chain", "target", {"tokens": block, "logits": block, "cache_capacity": capacity}),
    ]
    if spec.uses_tree_profile:
        tree = _exact(spec.verify_tokens)
        profiles.append(Profile("verify_tree", "target", {"tokens": tree, "logits": tree, "cache_capacity": capacity}))
    for budget in spec.extra_budgets:
        extra = spec.with_budget(budget)
        if extra.uses_tree_profile and extra.verify_tokens != spec.verify_tokens:
            tree = _exact(extra.verify_tokens)
            name = f"verify_tree_{extra.verify_tokens}"
            profiles.append(Profile(name, "target", {"tokens": tree, "logits": tree, "cache_capacity": capacity}))
    return {p.name: p for p in profiles}


def verify_profile_name(spec: SpecConfig, profiles: dict[str, Profile]) -> str:
    """The engine profile a runtime spec verifies with: verify_chain for a tree that fits the block, else the tree
    profile of exactly budget + 1 tokens (verify_tree or one of the extra budgets' verify_tree_N)."""
    if not spec.uses_tree_profile:
        return "verify_chain"
    for name, profile in profiles.items():
        if (name == "verify_tree" or name.startswith("verify_tree_")) and profile.fixed("tokens") == spec.verify_tokens:
            return name
    trees = sorted(p.fixed("tokens") - 1 for n, p in profiles.items() if n.startswith("verify_tree"))
    raise ValueError(
        f"budget={spec.budget} needs a {spec.verify_tokens}-token verify_tree profile; the engine verifies tree "
        f"budgets {trees or 'none'} and any budget below block_size={spec.block_size} "
        f"(rebuild with --ddtree_budget {spec.budget}, or add it with --extra_budgets)"
    )


def check_runtime_spec(spec: SpecConfig, profiles: dict[str, Profile]) -> None:
    """A runtime spec (e.g. a --ddtree_budget override) must fit the engine's verify profiles."""
    chain = profiles["verify_chain"].fixed("tokens")
    if chain != spec.block_size:
        raise ValueError(
            f"block_size={spec.block_size} needs an {spec.block_size}-token verify_chain profile; got {chain}"
        )
    for budget in spec.budgets:
        verify_profile_name(spec.with_budget(budget), profiles)
