"""A thin engine session per rank: `run(profile, feeds) -> outputs`, every feed shape-checked against the named
profile first. Backends: `TorchSession` (per-rank torch modules; CPU reference and CUDA), `runner.sessions.ort`
(the engine dir's ONNX graphs under ONNX Runtime), `runner.sessions.trt` (TensorRT engines)."""

from __future__ import annotations

import torch

from engines.io import TensorIO, check_feeds
from engines.spec import Profile


class EngineSession:
    backend = "abstract"
    prefill_buckets: tuple[int, ...] = ()  # lengths a prefill is padded up to (`RankWorker.prefill`; empty: none)

    def __init__(self, profiles: dict[str, Profile], io: dict[str, tuple[list[TensorIO], list[TensorIO]]]):
        self.profiles, self.io = profiles, io
        self._checked: set = set()

    def profile(self, name: str) -> Profile:
        if name not in self.profiles:
            raise ValueError(f"the engine has no profile {name!r}; it has {sorted(self.profiles)}")
        return self.profiles[name]

    def run(self, profile_name: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        profile = self.profile(profile_name)
        shapes = {name: tuple(t.shape) for name, t in feeds.items()}
        key = (profile_name, tuple(sorted(shapes.items())))
        if key not in self._checked:  # every new combination of shapes is checked once, then remembered
            check_feeds(profile, self.io[profile.role][0], shapes)
            self._checked.add(key)
        return self.execute(profile, feeds)

    def execute(self, profile: Profile, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


def length_buckets(longest: int) -> list[int]:
    """Each power of two and one and a half times it, up to `longest`, and `longest` itself: the prompt lengths a GPU's
    warm-up prefills (a GEMM's kernel is chosen by row-count ranges) and the lengths a prefill graph is captured at
    (a prompt is padded up to the next one: at most half again its rows)."""
    lengths, power = {longest}, 1
    while power <= longest:
        lengths.update(n for n in (power, power + power // 2) if n <= longest)
        power *= 2
    return sorted(lengths)


class TorchSession(EngineSession):
    """Eager per-rank modules: the numerical reference of every other backend."""

    backend = "torch"

    def __init__(self, target, drafter, profiles, io):
        super().__init__(profiles, io)
        self.modules = {"target": target, "draft": drafter}
        self.device = target.lm_head.weight.device

    @torch.no_grad()
    def execute(self, profile, feeds):
        inputs, outputs = self.io[profile.role]
        results = self.modules[profile.role](*(feeds[t.name].to(self.device, non_blocking=True) for t in inputs))
        return {t.name: value for t, value in zip(outputs, results)}
