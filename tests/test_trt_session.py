"""What the TensorRT runtime decides without a GPU: buffer plans, CUDA-graph eligibility, profile checks."""

import pytest

from engines.io import draft_io, target_io
from engines.spec import BuildConfig, SpecConfig, derive_profiles
from models.checkpoint import load_checkpoint_config
from runner.sessions.base import EngineSession
from runner.sessions.trt import graph_capturable, plan_buffers


@pytest.fixture(scope="module")
def setup(demo_ckpt):
    config = load_checkpoint_config(demo_ckpt(8))
    target, drafter = config.rank_configs(3)
    io = {"target": target_io(target, drafter), "draft": draft_io(target, drafter)}
    return derive_profiles(SpecConfig(8, 32), BuildConfig(max_input_len=64, max_seq_len=512)), io


def test_buffer_plans_per_profile(setup):
    profiles, io = setup
    tree = {b.name: b for b in plan_buffers(profiles["verify_tree"], *io["target"])}
    assert tree["input_ids"].shape == (33,) and tree["tree_mask"].shape == (33, 33)
    assert tree["logits"].shape == (33, 512) and tree["new_latent_kv"].shape == (4, 33, 40)
    assert tree["latent_cache"].in_place and tree["latent_cache"].shape == (4, 512, 40)
    prefill = {b.name: b for b in plan_buffers(profiles["prefill"], *io["target"])}
    assert prefill["input_ids"].shape == (64,) and prefill["logits"].shape == (64, 512)
    draft = {b.name: b for b in plan_buffers(profiles["draft"], *io["draft"])}
    assert draft["draft_logits"].shape == (7, 512)  # block_size - 1 rows
    assert draft["draft_cache"].in_place and draft["draft_cache"].shape == (2, 2, 512, 1, 16)  # 1 kv head at TP-8


def test_only_fixed_shape_profiles_get_a_cuda_graph(setup):
    profiles, _ = setup
    assert {n for n, p in profiles.items() if graph_capturable(p)} == {"draft", "decode", "verify_chain", "verify_tree"}


def test_feeds_are_checked_against_the_named_profile(setup):
    import torch

    profiles, io = setup
    session = EngineSession(profiles, io)
    feeds = {
        t.name: torch.zeros(8 if d == "tokens" else 1, dtype=torch.int64) for t in io["target"][0] for d in t.dims[:1]
    }
    with pytest.raises(ValueError, match=r"profile verify_tree: input input_ids expected shape \[33\]"):
        session.run("verify_tree", feeds)
    with pytest.raises(ValueError, match=r"the engine has no profile 'verify'; it has \['decode', 'draft'"):
        session.run("verify", feeds)


def test_the_parser_link_made_by_another_process_first_is_taken(tmp_path, monkeypatch):
    """Two processes (parallel test workers, two builds) both see no libtensorrt_rtx.so and race to make it: the one
    that loses finds it made and goes on; a link that leads nowhere is an error that names it."""
    import sys
    import types
    from pathlib import Path

    from plugins import tensorrt

    (tmp_path / "libtensorrt_rtx.so.1").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "tensorrt_rtx_libs", types.SimpleNamespace(__file__=str(tmp_path / "x.py")))
    link = tmp_path / "libtensorrt_rtx.so"
    real_symlink = Path.symlink_to

    def racing(self, target):  # the other process makes the link just before this one does
        real_symlink(self, target)
        raise FileExistsError(17, "File exists")

    monkeypatch.setattr(Path, "symlink_to", racing)
    assert tensorrt.ensure_rtx_parser_link() == link and link.exists()
    link.unlink()
    monkeypatch.setattr(Path, "symlink_to", lambda self, target: (real_symlink(self, "missing"), racing(self, target)))
    with pytest.raises(RuntimeError, match="does not lead to"):
        tensorrt.ensure_rtx_parser_link()
