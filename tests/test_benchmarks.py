"""The GPU benchmark scripts run end to end on the CPU at tiny shapes (--smoke): the rows they write are complete, and
every generation in them (host loop, device loop, oracle or random drafter) equals greedy autoregressive decoding."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_runtime_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "benchmarks/gpu_runtime.py", str(tmp_path), "--smoke", "--e2e-only",
                           "--models=dense,kimi-rank", "--temperatures=0,1"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_runtime.json").read_text())["end_to_end"]
    for model in ("dense", "kimi-rank"):
        mine = [r for r in rows if r["model"] == model]
        modes = {(r["mode"], r["drafter"]) for r in mine}
        assert ("autoregressive (device loop)", "-") in modes and ("ddtree 32 (device loop)", "oracle") in modes
        assert (("ddtree 32", "oracle") in modes) == (model == "dense")  # host-loop rows for the small models only
        sampled = [r for r in mine if r["temperature"] == 1.0]  # every device-loop row again, sampled on the device
        assert len(sampled) == 9 and all("device loop" in r["mode_printed"] and r["repeats_agree"] for r in sampled)
        for r in mine:
            assert r["tokens_per_s"] > 0 and r["speedup"] > 0
            if r in sampled:
                assert r["tokens_equal_to_autoregressive"] is None and r["tokens"] == 24
            elif r["mode"] != "autoregressive":
                assert r["tokens_equal_to_autoregressive"] == r["tokens"] == 24, r
            if r["drafter"] == "oracle":
                assert r["mean_accept_length"] > 7, r


def test_profile_forward_side_stream_and_int4_kernel_forms_smoke(tmp_path):
    """`profile_forward.py --compare-overlap` finds every MoE layer's branch (the "moe" preset: all but the dense first
    layer), runs each form and records that its logits equal the factory's form (on the CPU the branches run in
    order whatever the setting; on a GPU the same check compares streams)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "benchmarks/profile_forward.py", str(tmp_path), "--smoke", "--model", "moe",
                           "--compare-overlap", "--compare-int4-kernels"], capture_output=True, text=True, env=env,
                          cwd=ROOT,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "profile_forward.json").read_text())
    moe_layers = result["layers"] - 1
    for tokens in (1, 8, 33):
        forms = result["forwards"][f"target T={tokens}"]["side_stream"]
        assert [f["beside"] for f in forms.values()] == [0, moe_layers, moe_layers]  # no MLA form on the CPU
        assert all(f["equal_output"] and f["graph_us"] > 0 for f in forms.values())
    # each forward with each form of the INT4 kernel it takes (a CPU and the moe preset run neither: the same
    # forward twice, so no difference)
    for tokens in (1, 8, 33):
        field = "token_kernel" if tokens == 1 else "block_kernel"
        forms = result["forwards"][f"target T={tokens}"][field]
        assert set(forms) == {"cuda", "triton"} and all(f["max_abs_diff"] == 0 for f in forms.values())


def test_convert_memory_smoke(tmp_path):
    """The convert benchmark at the tiny model's dimensions: it writes the synthetic INT4 checkpoint, converts it as a
    user would and reports a peak memory and a read rate."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = tmp_path / "convert_memory.json"
    done = subprocess.run([sys.executable, "benchmarks/convert_memory.py", str(tmp_path / "work"), "--smoke",
                           "--tp_size", "2", "--repeats", "1", "--out", str(out)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["peak_anon_bytes"] > 0 and result["read_gb_per_s"] > 0 and result["model"]["moe_layers"] == 2
    assert result["runs"][0]["files"] == 4  # target and drafter, one file a rank (the tiny model fits one shard)


def test_int4_moe_gpu_smoke(tmp_path):
    """The W4A16 kernel benchmark at tiny dimensions, its kernel run by the Triton interpreter: every row checked
    against the reference and complete."""
    from tests.interpreter import run_interpreted

    done = run_interpreted(f"""
        from benchmarks.int4_moe_gpu import main
        assert main([{str(tmp_path)!r}, "--smoke", "--repeats", "1", "--tokens", "1,33"]) == 0
    """)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "int4_moe_gpu.json").read_text())["rows"]
    assert [(r["routing"], r["tokens"]) for r in rows] == [("random", 1), ("random", 33), ("skewed", 1), ("skewed", 33)]
    for r in rows:
        assert r["kernel_relative_error"] < 1e-5 and r["grouped_bf16_relative_error"] < 2e-2
        assert 0 < r["distinct_experts"] <= 4 * r["tokens"] and r["floor_us"] > 0 and r["layer_us"] > 0


def test_int4_load_probe_smoke(tmp_path):
    """The load-shape probe at tiny dimensions under the Triton interpreter: every shape's fold of its expert words
    (uneven K splits included) equals numpy's."""
    from tests.interpreter import run_interpreted

    done = run_interpreted(f"""
        from benchmarks.int4_load_probe import main
        assert main([{str(tmp_path)!r}, "--smoke"]) == 0
    """)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "int4_load_probe.json").read_text())["rows"]
    assert len(rows) == 8 and all(r["correct"] for r in rows) and {r["splits"] for r in rows} == {1, 3}


def test_l2_flush_probe_smoke(tmp_path):
    """The flush probe at small shapes on the CPU: every form runs under each flush, a row each with its floor."""
    from tests.interpreter import run_interpreted

    done = run_interpreted(f"""
        from benchmarks.l2_flush_probe import main
        assert main([{str(tmp_path)!r}, "--smoke", "--repeats", "1"]) == 0
    """)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "l2_flush_probe.json").read_text())["rows"]
    assert [r["form"].split()[0] for r in rows] == ["read", "copy", "int4", "int4", "int4"]
    assert [r["form"].split(", ")[1].split(" (")[0] for r in rows[2:]] == ["CUDA C", "Triton", "tensor cores"]
    columns = {"write_us", "read_us", "none_us", "sequence_us"}
    assert all(r["floor_us"] > 0 and r["bytes"] > 0 and columns <= set(r) for r in rows)


@pytest.mark.parametrize("synthetic", [False, True])
def test_kimi_rank_int4_smoke(tmp_path, synthetic):
    """The whole-rank INT4 benchmark at tiny shapes: packed experts through the factory, every mode at one context,
    every generation equal to the autoregressive one, the memory block written; with --synthetic-context, the
    context is 30 random cached rows and a 10-token prompt."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    extra = ["--synthetic-context", "--prompt", "10"] if synthetic else ["--auto-budget", "--batches", "2"]
    done = subprocess.run([sys.executable, "benchmarks/kimi_rank_int4.py", str(tmp_path), "--smoke", "--repeats", "1",
                           "--contexts", "40", *extra], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "kimi_rank_int4.json").read_text())
    assert result["memory"]["target_weight_bytes"] > 0 and len(result["rows"]) == (9 if synthetic else 22)
    batched = [r for r in result["rows"] if r.get("batch")]  # --batches 2: two copies of the request per step
    assert len(batched) == (0 if synthetic else 9) and all("batched: up to 2" in r["mode_printed"] for r in batched)
    # `auto` leaves its autoregressive steps' drafter rows pending (the default); "auto eager" commits each at once
    autos = [(r["lazy_context"], "eager context" in r["mode"]) for r in batched if "ddtree auto" in r["mode"]]
    assert all(r["context_rows"] == 8 for r in batched)  # on a CPU a block (`BatchLoop.context_rows`)
    assert autos == ([] if synthetic else [(True, False), (True, False), (False, True), (False, True)])
    for r in batched:  # `auto` batches too (random and oracle): the batch policy's choices recorded
        # the decode time is the wall time less the admissions (together: one prefill forward for both requests,
        # counted once), so it holds every step's own time
        assert all(d >= s > 0 for d, s in zip(r["decode_seconds"], r["steps_seconds"])), r
        steps = {b: n for slots in r.get("batch_policy", {}).values() for b, n in slots["steps"].items()}
        assert ("ddtree auto" in r["mode"]) == bool(steps) and set(steps) <= {"0", "8", "16", "32"}, r
    for r in result["rows"]:
        assert "INT4 experts" in r["ranks"] and r["tokens_equal_to_autoregressive"] == r["tokens"] == 16, r
        assert r["synthetic_rows"] == (30 if synthetic else 0)
    several = [r for r in result["rows"] if "of 8/16/32" in r["mode"] and not r.get("batch")]  # a graph a budget
    assert len(several) == (0 if synthetic else 4)
    for r in several:
        assert "device loop" in r["mode_printed"] and sum(r["budgets_chosen"].values()) > 0, r
        if r["mode"].startswith("ddtree 8"):
            assert list(r["budgets_chosen"]) == ["8"]
        else:
            assert set(r["measured_step_ms"]) == {"8", "16", "32"}


def test_chunked_prefill_benchmark_smoke(tmp_path):
    """The chunked-prefill benchmark at a short prompt on the CPU: a process per chunk size, the chunked logits equal
    to the whole prompt's, and a smaller peak with chunks."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "benchmarks/chunked_prefill.py", str(tmp_path), "--prompt", "768",
                           "--chunks", "0,128", "--repeats", "1"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "chunked_prefill.json").read_text())["rows"]
    assert [r["chunk"] for r in rows] == [0, 128] and rows[1]["max_abs_logit_difference"] < 1e-3
    assert 0 < rows[1]["peak_above_ranks_bytes"] < rows[0]["peak_above_ranks_bytes"]


def test_tokenizer_speed_benchmark_smoke(tmp_path):
    """Both tokenizer layouts of the trained pair's BPE: round trips through encode, decode and streaming."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "benchmarks/tokenizer_speed.py", str(tmp_path), "--repeats", "1",
                           "--stream_tokens", "100"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "tokenizer_speed.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["round_trip"] and r["tokens"] > 100000 for r in rows)


def test_sampling_speed_smoke(tmp_path):
    """The sampler benchmark on the CPU (the tensor-op draw on both sides): it writes complete rows."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "benchmarks/sampling_speed.py", str(tmp_path), "--smoke"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "sampling_speed.json").read_text())["rows"]
    assert [(r["rows"], r["same_tokens"]) for r in rows] == [(1, 1), (33, 33)]
    assert all(r[k] > 0 for r in rows for k in r if k.endswith("_us"))


def test_budget_traces_smoke(tmp_path):
    """The trace-driven budget evaluation on 3 prompts: traces recorded through the rank factory, the replay's rows
    complete, every fixed budget's and auto's tokens/s positive, auto no faster than its choices allow."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "benchmarks/budget_traces.py", str(tmp_path), "--smoke"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "budget_traces.json").read_text())
    assert {r["temperature"] for r in result["rows"]} == {0.0, 1.0} and len(result["traces"]["0.0"]) == 3
    for r in result["rows"]:
        rates = r["tokens_per_s"]
        assert all(v > 0 for v in rates.values()) and sum(r["budgets_chosen"].values()) == r["steps"] > 0
        assert rates["auto"] <= max(rates[f"ddtree {b}"] for b in (8, 16, 32)) * 1.5


def test_the_per_step_bound_is_the_best_any_per_step_choice_reaches():
    """`budget_traces.per_step_bound`: on small random instances, the rate equals the best of every per-step choice
    (all of them enumerated) and is at least every fixed budget's; its choice counts reach that rate."""
    import itertools

    import numpy as np

    from benchmarks.budget_traces import per_step_bound

    rng = np.random.default_rng(0)
    for _ in range(20):
        tokens = rng.integers(1, 9, size=(6, 3)).astype(np.float64)
        seconds = np.sort(rng.uniform(1.0, 3.0, size=3))
        best = max(tokens[np.arange(6), list(c)].sum() / seconds[list(c)].sum()
                   for c in itertools.product(range(3), repeat=6))  # fmt: skip
        rate, counts = per_step_bound(tokens, seconds)
        assert abs(rate - best) <= 1e-9 * best and counts.sum() == 6
        assert rate >= (tokens.sum(axis=0) / (6 * seconds)).max() - 1e-12


def test_budget_traces_batch_rates_from_the_batched_rows():
    """`budget_traces --batch-costs`: a batched step's cost is the batch over the batched row's tokens/s (the random
    drafter's rows, one token a request a step), and each budget's rate is the batch times the traces' mean tokens a
    step at that budget (a path's nodes up to the budget) over that cost."""
    from benchmarks.budget_traces import RESULTS, batch_rates, batch_step_costs

    costs = batch_step_costs(RESULTS / "kimi_rank_batch.json")
    assert set(costs) == {(1024, 4)} and set(costs[(1024, 4)]) == {"autoregressive", 8, 32}
    assert abs(costs[(1024, 4)]["autoregressive"] - 4 / 283.9906233138556) < 1e-12
    scores = [-0.5 * i for i in range(32)]  # the tree's best-first path log-probabilities (what `auto` reports)
    steps = [{"path": [0, 1, 2, 9], "scores": scores}, {"path": [0, 5], "scores": scores}]  # at 8: 3, 2; at 32: 4, 2
    traces = [{"steps": steps * 16}] * 8
    rates = batch_rates(traces, {"autoregressive": 0.01, 8: 0.02, 32: 0.05}, 4)
    fixed = {k: v for k, v in rates["tokens_per_s"].items() if k != "auto"}
    assert fixed == {"autoregressive": 400.0, "ddtree 8": 500.0, "ddtree 32": 240.0}
    assert rates["over_autoregressive"]["ddtree 8"] == 1.25 and rates["mean_accept_length"] == {"8": 2.5, "32": 3.0}
    # `auto`, the batch's policy over those costs: budget 8 where it is the best, learning at 32 first (its steps
    # tell 8 too), and autoregressive steps where a budget-8 step costs more than its tokens are worth
    assert 0.97 * 500.0 < rates["tokens_per_s"]["auto"] < 500.0 and rates["auto_steps"]["8"] > 50
    assert rates["auto_steps"]["32"] >= 1 and "0" not in rates["auto_steps"]
    rates = batch_rates(traces, {"autoregressive": 0.01, 8: 0.04, 32: 0.05}, 4)
    assert 0.97 * 400.0 < rates["tokens_per_s"]["auto"] < 400.0 and rates["tokens_per_s"]["ddtree 8"] == 250.0
    assert rates["auto_steps"]["0"] > 100 and "8" not in rates["auto_steps"]


def test_synthetic_context_rows_are_cached_and_attended():
    """`Probes.context_rows` (benchmarks' long context without a long prefill): every request starts after that many
    cached rows of seeded random K/V, the steps attend to them (the output differs from the same prompt without
    them), the same rows every request, and greedy speculation over them still equals autoregressive decoding."""
    import torch

    from benchmarks.common import Setup, preset_ranks
    from engines.spec import BuildConfig, SpecConfig
    from runner.factory import PresetWeights
    from runner.probes import Probes

    setup = Setup(True, torch.device("cpu"), torch.float32, 1)
    weights = PresetWeights("kimi-rank", torch.float32, seed=3, smoke=True)
    prompt, limits = [3, 17, 29, 5, 11], BuildConfig(64, 256)

    def tokens(autoregressive: bool, rows: int) -> list[int]:
        spec = SpecConfig(8, 32)
        generator = preset_ranks(weights, setup, spec, True, autoregressive, Probes(context_rows=rows), limits)
        first = generator.generate(prompt, 20).tokens
        assert generator.ranks.lead.cache.num_cached >= rows + len(prompt)
        again = generator.generate(prompt, 20).tokens
        generator.ranks.close()
        assert again == first  # the same synthetic rows for every request
        return first

    with_context = tokens(True, 100)
    assert tokens(False, 100) == with_context != tokens(True, 0)


def test_concurrency_benchmark_smoke(tmp_path):
    """The concurrency benchmark on the tiny model: the CLI one at a time and batched (equal outputs), and a real
    tritonserver with the four models, at one and two concurrent requests."""
    if not (Path(os.environ.get("DDTREE_TRITON_VENV", ROOT / ".venv-triton")) / "bin" / "python").exists():
        pytest.skip("no Triton venv (`make test` creates it)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "benchmarks/concurrency.py", str(tmp_path), "--smoke", "--repeats", "2"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "concurrency.json").read_text())
    assert len(result["cli"]) == 15 and all(r["tokens"] == 8 * r["requests"] for r in result["cli"])
    batched = [r for r in result["cli"] if r["max_batch_size"] > 1]
    assert len(batched) == 5 and all(r["equal_to_one_at_a_time"] for r in batched)
    chain = next(r for r in batched if r["cli_mode"] == "DFlash chain")
    assert chain["mode"].startswith("DFlash chain (block 8), device loop")  # its own engine: budget 7, one branch
    # two runs of each batched job, the row the slower one's (the lower middle of two)
    assert all(len(r["repeats_tokens_per_s"]) == 2 for r in batched)
    assert all(round(r["tokens_per_s"], 2) == min(r["repeats_tokens_per_s"]) for r in batched)
    assert [r["requests"] for r in result["phases"]] == [1, 8] and all(r["verify"] > 0 for r in result["phases"])
    assert all(r["decode, a block's context"] > 0 and r["decode, one row's context"] > 0 for r in result["phases"])
    auto = [r for r in batched if r["cli_mode"].startswith("DDTree auto")]
    assert (
        auto and set(auto[0]["budgets_chosen"]) <= {"0", "8", "16", "32"} and auto[0]["budgets_chosen"]
    )  # 0: autoregressive steps
    assert all("batched: up to 2 requests a step" in r["mode"] for r in batched)
    assert {(r["model"], r["clients"]) for r in result["triton_server"]} == {
        (m, c) for m in ("ddtree", "ddtree-batched", "ar", "ar-batched", "chain-batched") for c in (1, 2)
    }
    assert all(r["connection"] == "kept" for r in result["triton_server"])  # each client's requests on one connection


def test_batch_policy_benchmark_smoke(tmp_path):
    """The batch policy's benchmark on the CPU with the trained pair (float32): CLI jobs of three batched requests in
    the order given (autoregressive last), `auto`'s with the policy's summary and each request's budgets, every job's
    tokens the first's (greedy speculative decoding is lossless whatever budget a step takes), each mode's median
    against autoregressive."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    args = ["--device", "cpu", "--requests", "3", "--tokens", "12", "--order", "auto,8,ar"]
    done = subprocess.run([sys.executable, "benchmarks/batch_policy.py", str(tmp_path), *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = json.loads((tmp_path / "batch_policy.json").read_text())["jobs"]
    assert [j["mode"] for j in jobs] == ["DDTree auto (8/16/32)", "DDTree 8", "autoregressive"]
    assert all(j["tokens_equal_to_the_first_job"] and j["tokens_equal_to_the_mode_s_first_job"] for j in jobs)
    assert all(j["tokens_per_s"] > 0 for j in jobs)
    auto = jobs[0]
    assert auto["policy"]["3"]["steps"] and set(auto["first_request_budgets"]) <= {0, 8, 16, 32}
    assert not jobs[1]["policy"] and not jobs[1]["first_request_budgets"]  # a fixed budget: no policy
    medians = [line for line in done.stdout.splitlines() if line.startswith("median ")]
    assert len(medians) == 3 and "x autoregressive" in medians[0], done.stdout[-2000:]


def test_serving_overhead_benchmark_smoke(tmp_path):
    """The serving-path benchmark on the tiny model: the runner's pipe and a real tritonserver side by side, every
    mode's row complete (each path's four requests timed, the runner's own time under the pipe's; `/generate` over a
    fresh connection a request and over one kept open; `--direct`: the job without mpirun too; `--slots 4`: the jobs
    and the server's models batched over 4 slots)."""
    if not (Path(os.environ.get("DDTREE_TRITON_VENV", ROOT / ".venv-triton")) / "bin" / "python").exists():
        pytest.skip("no Triton venv (`make test` creates it)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "benchmarks/serving_overhead.py", str(tmp_path), "--smoke", "--direct",
                           "--slots", "4"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "serving_overhead.json").read_text())
    rows = result["rows"]
    config = (tmp_path / "repo" / "ddtree" / "config.pbtxt").read_text()
    assert result["slots"] == 4 and 'key: "max_batch_size" value: { string_value: "4" }' in config
    assert [(r["mode"], r["tokens"]) for r in rows] == [("DDTree 8", 8), ("DDTree auto", 8), ("autoregressive", 8)]
    for r in rows:
        assert len(r["pipe"]) == len(r["triton"]) == len(r["triton_stream"]) == len(r["direct"]) == 4
        # the kept connection's requests went over the connection the warm-up request opened: the server kept it
        assert len(r["triton_kept"]) == r["kept_reused"] == 4 and r["triton_kept_ms"] > 0
        assert all(0 < elapsed <= whole for whole, elapsed in r["pipe"] + r["direct"])
        assert all(first is not None and 0 < first <= whole for whole, first in r["triton_stream"])


def test_batch_timeline_splits_the_gpu_time_into_calls_and_idle_gaps(tmp_path):
    """The arithmetic over recorded events (stand-ins with timestamps in ms), then the jobs on the CPU (no timeline
    there: events time graph replays)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.batch_timeline import timeline

    class Event:
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, other):
            return other.ms - self.ms

    calls = [("admission of 1", 0.0, 1.0), ("step", 1.5, 3.5), ("step", 3.7, 5.7), ("load", 6.0, 6.1)]
    calls.append(("step", 6.2, 8.2))
    got = timeline([(kind, Event(a), Event(b)) for kind, a, b in calls])
    assert got["timeline_ms"] == 8.2 and got["idle_ms"] == round(0.5 + 0.2 + 0.3 + 0.1, 2)
    assert got["idle_share"] == round(1.1 / 8.2, 4)
    step = got["kinds"]["step"]
    assert step["count"] == 3 and step["span_ms"] == 6.0 and step["idle_before_ms"] == 0.8
    assert step["idle_before_ms_median"] == 0.2 and got["kinds"]["admission of 1"]["idle_before_ms_median"] is None
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "benchmarks/batch_timeline.py", str(tmp_path), "--device", "cpu", "--smoke",
                           "--requests", "5", "--slots", "2", "--tokens", "8"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "batch_timeline.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["autoregressive", "DDTree 8", "DDTree 8 profile"]
    for row in rows:
        admitted = sum(a["admissions"] for a in row["admissions"].values())
        assert row["tokens"] == 5 * 8 and row["kinds"] == {} and admitted >= 3
    assert rows[1]["outputs_sha1"] == rows[2]["outputs_sha1"]  # lone admissions on the prefill profile: the same tokens
