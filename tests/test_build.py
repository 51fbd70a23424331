"""The builder: TensorRT-RTX engines on the CPU with the plugin and named profiles; ONNX == torch everywhere."""

import json
import re
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from builder.cli import main as cli_main
from builder.trt_build import BuildError, build_engine
from engines.engine_dir import load_engine_dir
from engines.io import TensorIO
from engines.spec import BuildConfig, Profile, SpecConfig, check_runtime_spec, derive_profiles
from plugins.tensorrt import import_tensorrt
from tests.conftest import mpirun


def test_tp8_engines_record_the_plugin_and_both_token_counts(demo_engine):
    engine = load_engine_dir(demo_engine(8))
    assert engine.tp_size == 8 and engine.config["engines"]["builder"] == "tensorrt_rtx"
    for rank in range(8):
        target, draft = engine.build_info(rank, "target"), engine.build_info(rank, "draft")
        for role in ("target", "draft"):
            plan = engine.engine_path(rank, role).read_bytes()
            assert len(plan) > 100_000
            assert b"AllReduce" in plan and b"AllGather" in plan
        assert b"TreeAttention" in engine.engine_path(rank, "target").read_bytes()
        assert sum(name.endswith("TreeAttention") for name in target["plugin_layers"]) == 4  # one per layer
        # the profiles as TensorRT's IOptimizationProfile reports them
        shapes = {name: p["shapes"]["input_ids"] for name, p in target["profiles"].items()}
        assert shapes["verify_tree"] == [[33], [33], [33]]
        assert shapes["verify_chain"] == [[8], [8], [8]]
        assert shapes["decode"] == [[1], [1], [1]]
        assert shapes["prefill"][0] == [1] and shapes["prefill"][2] == [64]
        assert draft["profiles"]["draft"]["shapes"]["block_ids"] == [[8], [8], [8]]
        fields = {p["op"]: p["fields"] for p in target["plugins"]}
        assert fields["TreeAttention"]["latent_dim"] == 32 and fields["AllGather"]["world_size"] == 8
    assert engine.config["profiles"]["verify_tree"]["dims"]["tokens"] == [33, 33, 33]


def test_an_engine_directory_of_an_older_schema_is_refused_with_the_rebuild_advice(demo_engine, tmp_path):
    """Schema 1's Int4MoE nodes lack `rows`, which the ONNX Runtime op and the plugin require: such a directory is
    refused by name before any graph loads."""
    from engines.engine_dir import ENGINE_SCHEMA

    config = json.loads((demo_engine(1) / "config.json").read_text())
    assert config["schema_version"] == ENGINE_SCHEMA == 2
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({**config, "schema_version": 1}))
    with pytest.raises(ValueError, match=r"schema_version 1 is not supported \(expected 2\); rebuild the engines"):
        load_engine_dir(old)


def test_inspect_shows_profiles_and_plugins(demo_engine, capsys):
    assert cli_main(["inspect", str(demo_engine(8))]) == 0
    text = capsys.readouterr().out
    assert "built by tensorrt_rtx" in text and "tp_size=8" in text
    assert "profile 3 verify_tree: input_ids=[33]" in text
    assert "profile 2 verify_chain: input_ids=[8]" in text
    assert "plugin ddtree::TreeAttention x4 (recorded in plan)" in text
    assert text.count("rank7/") == 2


def test_onnx_matches_torch_in_process(demo_engine):
    """TP=1, one process: every output at every profile shape."""
    from runner.check_onnx import check_rank
    from runner.mpi import comm_world

    rows = check_rank(load_engine_dir(demo_engine(1)), 0, comm_world())
    sizes = {(name, size) for name, size, _, _ in rows}
    assert {("verify_chain", 8), ("verify_tree", 33), ("decode", 1), ("draft", 8)} <= sizes
    assert len({size for name, size in sizes if name == "prefill"}) >= 2
    assert max(error for *_, error in rows) < 1e-4


@pytest.mark.mpi
@pytest.mark.parametrize("tp_size", [2, 8])
def test_onnx_matches_torch_under_mpirun(demo_engine, tp_size):
    done = mpirun(tp_size, "-m", "runner.check_onnx", str(demo_engine(tp_size)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"verify_tree +33 tokens +logits", done.stdout) and "OK: 26/26" in done.stdout


def test_profiles_must_hold_the_spec(demo_ckpt, tmp_path, capsys):
    with pytest.raises(ValueError, match="budget=32 needs a 33-token verify_tree profile; got max_num_tokens=8"):
        derive_profiles(SpecConfig(8, 32), BuildConfig(max_num_tokens=8))
    args = [
        "build",
        "--checkpoint_dir",
        str(demo_ckpt(2)),
        "--output_dir",
        str(tmp_path / "e"),
        "--ddtree_budget",
        "32",
        "--max_num_tokens",
        "8",
    ]
    assert cli_main(args) == 2
    assert "budget=32 needs a 33-token verify_tree profile; got max_num_tokens=8" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    profiles = derive_profiles(SpecConfig(8, 32), BuildConfig())
    with pytest.raises(ValueError, match=r"budget=64 needs a 65-token verify_tree profile; the engine verifies tree "
                       r"budgets \[32\] and any budget below block_size=8"):  # fmt: skip
        check_runtime_spec(SpecConfig(8, 64), profiles)
    check_runtime_spec(SpecConfig(8, 4), profiles)  # a smaller tree fits the chain profile, padded
    with pytest.raises(ValueError, match="max_batch_size=4 is not supported"):
        BuildConfig(max_batch_size=4)


@pytest.mark.parametrize(
    ("block_size", "budget", "tree_tokens", "verify_tokens"),
    [(8, 6, None, 8), (8, 7, None, 8), (8, 8, 9, 9), (8, 32, 33, 33), (2, 1, None, 2), (2, 2, 3, 3)],
)
def test_profiles_at_the_chain_and_tree_boundary(block_size, budget, tree_tokens, verify_tokens):
    """budget + 1 <= block_size fits the chain profile (padded rows masked); one more node needs a tree profile."""
    spec = SpecConfig(block_size, budget)
    profiles = derive_profiles(spec, BuildConfig(max_input_len=64, max_seq_len=512))
    assert spec.verify_tokens == verify_tokens
    assert profiles["verify_chain"].fixed("tokens") == block_size == profiles["draft"].fixed("block")
    assert (profiles["verify_tree"].fixed("tokens") if "verify_tree" in profiles else None) == tree_tokens
    assert profiles[spec.verify_profile].fixed("tokens") == verify_tokens
    check_runtime_spec(spec, profiles)


def test_extra_budgets_get_a_verify_profile_each_and_run_time_picks_one():
    """One spec, several tree budgets: a verify_tree_N profile for each extra budget (none where the chain profile or
    the main tree profile already has the size), every one resolvable at run time, any other budget refused."""
    from engines.spec import verify_profile_name

    spec = SpecConfig(8, 32, extra_budgets=(4, 8, 16, 32))
    profiles = derive_profiles(spec, BuildConfig(max_input_len=64, max_seq_len=512))
    trees = {n: p.fixed("tokens") for n, p in profiles.items() if n.startswith("verify_tree")}
    assert trees == {"verify_tree": 33, "verify_tree_9": 9, "verify_tree_17": 17}
    assert spec.budgets == (4, 8, 16, 32) and SpecConfig(**spec.to_dict()) == spec  # the engine directory's record
    check_runtime_spec(spec, profiles)
    names = {b: verify_profile_name(spec.with_budget(b), profiles) for b in (4, 7, 8, 16, 32)}
    assert names == {4: "verify_chain", 7: "verify_chain", 8: "verify_tree_9", 16: "verify_tree_17", 32: "verify_tree"}
    with pytest.raises(ValueError, match=r"budget=12 needs a 13-token verify_tree profile; the engine verifies tree "
                       r"budgets \[8, 16, 32\]"):  # fmt: skip
        check_runtime_spec(SpecConfig(8, 12), profiles)
    with pytest.raises(ValueError, match="budget=16 needs a 17-token verify_tree profile; got max_num_tokens=9"):
        derive_profiles(SpecConfig(8, 8, extra_budgets=(16,)), BuildConfig(max_num_tokens=9))
    with pytest.raises(ValueError, match="extra_budgets must be >= 1"):
        SpecConfig(8, 32, extra_budgets=(0,))


def test_a_block_longer_than_the_prompt_limit_is_refused():
    with pytest.raises(ValueError, match="block_size=16 must be <= max_input_len=8"):
        derive_profiles(SpecConfig(16, 32), BuildConfig(max_input_len=8, max_seq_len=512))
    derive_profiles(SpecConfig(8, 32), BuildConfig(max_input_len=8, max_seq_len=512))  # equal is allowed


def test_one_shot_build_rejects_non_dividing_tp(demo_hf, tmp_path, capsys):
    args = [
        "--model_dir",
        str(demo_hf / "kimi-k2-tiny"),
        "--draft_model_dir",
        str(demo_hf / "kimi-k2-tiny-dflash"),
        "--tp_size",
        "3",
        "--output_dir",
        str(tmp_path / "e"),
    ]
    assert cli_main(args) == 2
    assert "tp_size=3 must divide num_attention_heads=8 (8 % 3 = 2)" in capsys.readouterr().err


def test_missing_plugin_creator_is_named(tmp_path):
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="ddtree")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ddtree", 1)])
    onnx.save(model, str(tmp_path / "g.onnx"))
    profile = Profile("p", "target", {"n": (1, 2, 4)})
    with pytest.raises(
        BuildError, match=r"no TensorRT plugin creator is registered for ddtree::NoSuchOp \(version 1\)"
    ):
        build_engine(import_tensorrt(), tmp_path / "g.onnx", [TensorIO("x", "float32", ("n", 4))], [profile])


def test_build_refuses_a_non_empty_output_dir(demo_ckpt, tmp_path, capsys):
    out = tmp_path / "e"
    out.mkdir()
    (out / "mine").write_text("keep")
    assert cli_main(["build", "--checkpoint_dir", str(demo_ckpt(2)), "--output_dir", str(out)]) == 2
    assert "not empty; pass --force" in capsys.readouterr().err and (out / "mine").read_text() == "keep"


def test_exported_graphs_name_every_dynamic_dim(demo_engine):
    graph = onnx.load(str(load_engine_dir(demo_engine(2)).onnx_path(1, "target")), load_external_data=False).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    assert dims["input_ids"] == ["tokens"] and dims["tree_mask"] == ["tokens", "tokens"]
    assert dims["latent_cache"] == [4, "cache_capacity", 40] and dims["logit_indices"] == ["logits"]
    record = json.loads((demo_engine(2) / "rank1" / "target.build.json").read_text())
    assert record["plan_records"]["TreeAttention"]


def test_the_one_step_build_never_replaces_its_inputs(demo_hf, tmp_path, capsys):
    """`build-engine --model_dir X ... --output_dir X --force` deleted the HF checkpoint X (and with X's parent as the
    output, the drafter too): both are refused before anything is converted, and the inputs stay whole."""
    import shutil

    hf = shutil.copytree(demo_hf, tmp_path / "hf")
    before = sorted(p.relative_to(hf) for p in hf.rglob("*"))
    target, drafter = hf / "kimi-k2-tiny", hf / "kimi-k2-tiny-dflash"
    for output in (target, hf, drafter):
        args = ["--model_dir", str(target), "--draft_model_dir", str(drafter), "--output_dir", str(output)]
        assert cli_main([*args, "--tp_size", "1", "--no_onnx", "--force"]) == 2
        assert "would replace the input" in capsys.readouterr().err
    assert sorted(p.relative_to(hf) for p in hf.rglob("*")) == before


def test_a_failed_forced_build_leaves_the_previous_engine(demo_ckpt, tmp_path, monkeypatch):
    """Everything is written beside the output and moved into place when complete: a --force rebuild that fails part
    way (here: after the checkpoint is linked) leaves the previous engine directory as it was, and no partial folder."""
    from builder import build

    out = tmp_path / "engine"
    spec, limits = SpecConfig(8, 32), BuildConfig(max_input_len=64, max_seq_len=512)
    build.build_engines(demo_ckpt(1), out, spec, limits, tensorrt="none", onnx=False)
    before = {p.relative_to(out): p.stat().st_size for p in out.rglob("*")}
    write = build._write_ranks

    def interrupted(staging, *args):
        write(staging, *args)
        raise KeyboardInterrupt  # Ctrl-C during the build

    monkeypatch.setattr(build, "_write_ranks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build.build_engines(demo_ckpt(1), out, spec, limits, force=True, tensorrt="none", onnx=False)
    assert {p.relative_to(out): p.stat().st_size for p in out.rglob("*")} == before
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]  # no .engine.partial-* left behind
    monkeypatch.setattr(build, "_write_ranks", write)
    build.build_engines(demo_ckpt(1), out, SpecConfig(8, 16), limits, force=True, tensorrt="none", onnx=False)
    assert load_engine_dir(out).spec.budget == 16 and [p.name for p in tmp_path.iterdir()] == ["engine"]


def test_an_interrupt_as_the_staging_folder_is_made_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C right after the staging folder is created (before anything is written into it) removes it too."""
    from engines import output_dir

    made = Path.mkdir

    def mkdir_then_interrupt(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if ".partial-" in self.name:
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt), output_dir.staged_output_dir(tmp_path / "out", force=False):
        pass
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_tensorrt_builds_is_raised_once_it_returns(capsys):
    """SIGINT inside `build_engine` (where TensorRT's Python callbacks would swallow the KeyboardInterrupt) is held:
    the code inside runs on, and the interrupt is raised when it is done; the handler before is restored."""
    import os
    import signal
    import time

    from builder.trt_build import deferred_interrupt

    before, finished = signal.getsignal(signal.SIGINT), []
    with pytest.raises(KeyboardInterrupt), deferred_interrupt():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs between these bytecodes: no KeyboardInterrupt here
        finished.append(True)
    assert finished == [True] and signal.getsignal(signal.SIGINT) is before
    assert "stopping once TensorRT returns" in capsys.readouterr().err


def test_ctrl_c_during_a_build_leaves_the_output_as_it_was(demo_hf, tmp_path):
    """SIGINT while the engines are being built: build-engine exits with 130 and says so, and leaves no output and no
    partial folder (a previous engine there would stay: `test_a_failed_forced_build_leaves_the_previous_engine`)."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "engine"
    command = [sys.executable, "-m", "builder.cli", "--model_dir", str(demo_hf / "kimi-k2-tiny"), "--draft_model_dir",
               str(demo_hf / "kimi-k2-tiny-dflash"), "--tp_size", "2", "--output_dir", str(out)]  # fmt: skip
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    for line in job.stdout:
        if line.split("] ")[-1].startswith("rank 0 ") and "engine:" in line:  # the first engine is built
            break
    job.send_signal(signal.SIGINT)
    rest = job.stdout.read()
    assert job.wait(60) == 130 and f"build-engine: interrupted; {out} is as it was" in rest
    assert list(tmp_path.iterdir()) == []
