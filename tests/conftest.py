"""Shared fixtures: the tiny demo checkpoints, generated once per test session from the fixed seed."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The slowest files first (about 300, 210, 160, 130, 130 and 110 s of the suite's ~1700 on the 2-core CI machine
# kind): `make test`'s workers take files in collection order, so one of these last would run alone at the end
SLOW_FIRST = ("test_runner_mpi.py", "test_int4_moe.py", "test_benchmarks.py", "test_build.py", "test_speculate.py",
              "test_triton.py")  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def demo_hf(tmp_path_factory) -> Path:
    """OUT/{kimi-k2-tiny, kimi-k2-tiny-int4, kimi-k2-tiny-tiktoken, kimi-k2-tiny-dflash}."""
    from builder.demo_checkpoints import write_drafter, write_target

    root = tmp_path_factory.mktemp("hf")
    write_target(root / "kimi-k2-tiny", int4_experts=False, force=False)
    write_target(root / "kimi-k2-tiny-int4", int4_experts=True, force=False)
    write_target(root / "kimi-k2-tiny-tiktoken", int4_experts=False, force=False, tiktoken=True)
    write_drafter(root / "kimi-k2-tiny-dflash", force=False)
    return root


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory) -> Path:
    """The trained pair's data prepared from this Python's stdlib (`python -m training.data`): tokenizer + tokens."""
    from training.data import prepare

    out = tmp_path_factory.mktemp("stdlib") / "data"
    prepare(out, force=False)
    return out


@pytest.fixture(scope="session")
def release_engine(demo_hf, tmp_path_factory):
    """TP-8 engine (torch backend) of the release-layout target: tiktoken tokenizer, chat template and a chat
    generation_config.json, as Kimi K2.x ships them."""
    from builder.cli import main as cli_main

    engine = tmp_path_factory.mktemp("release") / "engine"
    args = ["--model_dir", str(demo_hf / "kimi-k2-tiny-tiktoken"), "--draft_model_dir",
            str(demo_hf / "kimi-k2-tiny-dflash"), "--tp_size", "8", "--output_dir", str(engine), "--max_input_len",
            "64", "--max_seq_len", "512", "--no_onnx"]  # fmt: skip
    assert cli_main(args) == 0
    return engine


@pytest.fixture(scope="session")
def demo_ckpt(demo_hf, tmp_path_factory):
    """Converted checkpoints by tp_size, made on first use."""
    from builder.convert import convert

    made: dict[int, Path] = {}

    def get(tp_size: int) -> Path:
        if tp_size not in made:
            out = tmp_path_factory.mktemp(f"ckpt-tp{tp_size}")
            convert(demo_hf / "kimi-k2-tiny", demo_hf / "kimi-k2-tiny-dflash", out, tp_size, force=True)
            made[tp_size] = out
        return made[tp_size]

    return get


def cpu_ranks(checkpoint_dir: Path, spec, build, **options):
    """Every rank of a converted checkpoint in this process on the CPU, through the rank factory (the reference
    the tests compare against); `options`: more `RankOptions` fields (device_loop, autoregressive, probes)."""
    from runner.factory import CheckpointWeights, RankOptions, local_ranks

    settings = {"device": "cpu", "device_loop": False, **options}
    return local_ranks(CheckpointWeights(checkpoint_dir), RankOptions(**settings), spec, build)


def fixed_cost_policy(costs: dict[int, float]):
    """A `StepBudgetPolicy` whose step costs stay `costs`, whatever the steps take (so a test decides which budget
    wins); acceptance it learns as usual."""
    from runner.device.budget import StepBudgetPolicy

    class FixedCosts(StepBudgetPolicy):
        def record(self, count, budget, seconds, stats):
            super().record(count, budget, costs[budget], stats)

    return FixedCosts(tuple(costs), costs)


def copy_checkpoint(src: Path, dst: Path, config_update: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if config_update:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_update)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


ENGINE_LIMITS = {"max_input_len": 64, "max_seq_len": 512}


@pytest.fixture(scope="session")
def demo_engine(demo_ckpt, tmp_path_factory):
    """Built engine directories (TensorRT-RTX plans + ONNX + checkpoint) by tp_size, made on first use."""
    from builder.build import build_engines
    from engines.spec import BuildConfig, SpecConfig

    made: dict[int, Path] = {}

    def get(tp_size: int) -> Path:
        if tp_size not in made:
            out = tmp_path_factory.mktemp(f"engine-tp{tp_size}") / "engine"
            build_engines(demo_ckpt(tp_size), out, SpecConfig(8, 32), BuildConfig(**ENGINE_LIMITS))
            made[tp_size] = out
        return made[tp_size]

    return get


@functools.cache
def _launcher_flags(launcher: str) -> tuple[str, ...]:
    """MPICH's launcher (hydra) prints every rank's exit status when asked: a job that fails then says which rank
    ended how, where by default it prints one status for all."""
    version = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=30).stdout
    return ("-print-all-exitcodes",) if "HYDRA" in version else ()


def mpirun(np: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Launches `python args...` on np ranks with the venv's MPI launcher."""
    launcher = str(Path(sys.executable).parent / "mpirun")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run(
        [launcher, *_launcher_flags(launcher), "-np", str(np), sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
