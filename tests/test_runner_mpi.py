"""`mpirun -np N python -m runner` end to end with the ort backend: equal to the single-process reference."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines.spec import BuildConfig, SpecConfig
from runner.sampling import Sampler, SamplingParams
from runner.speculate import generate_autoregressive
from runner.tokenizer import load_tokenizer
from tests.conftest import ENGINE_LIMITS, cpu_ranks, mpirun

PROMPTS = ["Hello world! Speculative decoding", "The quick brown fox jumps"]
pytestmark = pytest.mark.mpi


def run(np_, engine, tmp_path, *extra, prompts=PROMPTS, max_output_len=48):
    out = tmp_path / f"out-{np_}-{len(list(tmp_path.iterdir()))}.json"
    args = [
        "-m",
        "runner",
        "--engine_dir",
        str(engine),
        "--backend",
        "ort",
        "--max_output_len",
        str(max_output_len),
        "--output_json",
        str(out),
        *extra,
    ]
    for prompt in prompts:
        args += ["--input_text", prompt]
    done = mpirun(np_, *args)
    return done, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def reference(demo_ckpt, demo_engine):
    """Single-process torch autoregressive greedy output (TP=1 checkpoint of the same model)."""
    tokenizer = load_tokenizer(demo_engine(2) / "tokenizer", 512)
    engine = cpu_ranks(demo_ckpt(1), SpecConfig(8, 32), BuildConfig(**ENGINE_LIMITS))
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        result = generate_autoregressive(engine, ids, 48, Sampler(SamplingParams()), end_ids={481})
        outputs.append(result.tokens)
    engine.close()
    return outputs


@pytest.mark.parametrize("np_", [8, 2])
def test_greedy_equals_single_process_reference(demo_engine, reference, tmp_path, np_):
    done, out = run(np_, demo_engine(np_), tmp_path, "--streaming")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert out["world_size"] == np_ and out["backend"] == "ort"
    assert [r["output_ids"] for r in out["results"]] == reference
    assert "mode: DDTree budget 32 (block 8), host loop" in done.stdout
    assert "[stats DDTree budget 32 (block 8), host loop]" in done.stdout
    assert "tokens/s (with the prefill" in done.stdout
    assert "mean acceptance length" in done.stdout
    assert "; time: prefill" in done.stdout and "verify" in done.stdout
    assert done.stdout.count("--- prompt") == 2


def test_sampling_is_reproducible_with_a_seed(demo_engine, tmp_path):
    sampled = ["--temperature", "0.8", "--top_p", "0.95", "--seed", "7"]
    first = run(2, demo_engine(2), tmp_path, *sampled, prompts=PROMPTS[:1], max_output_len=24)[1]
    second = run(2, demo_engine(2), tmp_path, *sampled, prompts=PROMPTS[:1], max_output_len=24)[1]
    other = run(2, demo_engine(2), tmp_path, *sampled[:-1], "8", prompts=PROMPTS[:1], max_output_len=24)[1]
    assert first["results"][0]["output_ids"] == second["results"][0]["output_ids"]
    assert first["results"][0]["output_ids"] != other["results"][0]["output_ids"]


def test_ranks_that_end_at_different_times_all_exit_cleanly():
    """`exit_rank` after the other ranks have already ended: every rank's exit status is 0 (MPICH's launcher killed
    the late ones with signal 9 in most such jobs when a rank skipped the C exit handlers). Two jobs of 8 ranks,
    rank 0 ending a second before the others."""
    script = ("import time; from mpi4py import MPI; from runner.mpi import exit_rank; "
              "time.sleep(0 if MPI.COMM_WORLD.Get_rank() == 0 else 1); exit_rank(0)")  # fmt: skip
    for _ in range(2):
        done = mpirun(8, "-c", script, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_a_failing_rank_aborts_the_job(demo_engine, tmp_path):
    broken = shutil.copytree(demo_engine(2), tmp_path / "broken")
    (broken / "rank1" / "target.onnx").write_bytes(b"not an onnx graph")
    done, _ = run(2, broken, tmp_path)
    assert done.returncode != 0
    assert "[rank 1] Traceback" in done.stderr and "aborting all 2 ranks" in done.stderr
    assert done.stderr.count("Traceback") == 1


def test_missing_rank_file_is_a_clear_error(demo_engine, tmp_path):
    broken = shutil.copytree(demo_engine(2), tmp_path / "incomplete")
    (broken / "rank1" / "draft.onnx").unlink()
    done, out = run(2, broken, tmp_path)
    assert done.returncode == 2 and out is None
    assert "incomplete for backend 'ort': missing rank1/draft.onnx" in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_requests_are_refused_before_any_output(demo_engine, tmp_path):
    long_prompt = "Hello world! " * 40
    done, out = run(2, demo_engine(2), tmp_path, prompts=[PROMPTS[0], long_prompt])
    assert done.returncode == 2 and out is None and "--- prompt" not in done.stdout
    assert "prompt 1: prompt of" in done.stderr and "longer than the engine's max_input_len=64" in done.stderr
    done, _ = run(2, demo_engine(2), tmp_path, max_output_len=500)
    assert done.returncode == 2 and "exceeds the engine's max_seq_len=512" in done.stderr
    done, _ = run(1, demo_engine(2), tmp_path)
    assert done.returncode == 2 and "built for tp_size=2; this job has world size 1" in done.stderr
    done, _ = run(2, tmp_path / "nowhere", tmp_path)
    assert done.returncode == 2 and "does not exist" in done.stderr
    done, _ = run(2, demo_engine(2), tmp_path, "--ddtree_budget", "64")
    assert done.returncode == 2 and "budget=64 needs a 65-token verify_tree profile; the engine verifies" in done.stderr
    done, _ = run(2, demo_engine(2), tmp_path, "--ddtree_budget", "auto")
    assert done.returncode == 2
    assert "auto chooses among several tree budgets; this engine verifies only [32]" in done.stderr
    done, _ = run(2, demo_engine(2), tmp_path, "--ddtree_budget", "0")  # 0 was taken as "the engine's budget"
    assert done.returncode == 2 and "budget=0 must be >= 1 tree node" in done.stderr
    done, _ = run(2, demo_engine(2), tmp_path, "--max_batch_size", "0")
    assert done.returncode == 2 and "--max_batch_size must be >= 1, got 0" in done.stderr
    done, _ = run(2, demo_engine(2), tmp_path, "--backend", "torch", "--loop", "device", "--max_batch_size", "2",
                  "--streaming")  # fmt: skip
    assert done.returncode == 2 and "--streaming prints one request at a time" in done.stderr
    for temperature in ("nan", "inf", "1e-40", "-1"):  # each crashed every rank inside the sampler
        done, _ = run(2, demo_engine(2), tmp_path, "--temperature", temperature)
        assert done.returncode == 2 and "temperature must be" in done.stderr, temperature


def test_no_prompt_ends_every_rank_with_an_error(demo_engine, tmp_path):
    """Rank 0 used to leave through parser.error while the other ranks waited in a collective for ever."""
    done, out = run(2, demo_engine(2), tmp_path, prompts=[])
    assert done.returncode == 2 and out is None and "give at least one prompt" in done.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    for path in (empty, tmp_path / "missing.txt"):
        done, _ = run(2, demo_engine(2), tmp_path, "--input_file", str(path), prompts=[])
        assert done.returncode == 2 and ("give at least one prompt" in done.stderr or "does not exist" in done.stderr)


def test_tokenizer_larger_than_the_vocab_is_refused(demo_engine):
    with pytest.raises(ValueError, match="has 512 ids but the engine's vocab_size is 256"):
        load_tokenizer(demo_engine(2) / "tokenizer", 256)


def test_device_loop_under_mpirun_equals_the_reference(demo_engine, reference, tmp_path):
    """--loop device: the speculative step (tree build, walk and commit as tensor ops) and, with --autoregressive, the
    decode step on every rank (torch backend, MPI collectives), each with the next step queued behind it; with
    --max_batch_size 2 both prompts in one batch (in-flight batching), speculative and autoregressive."""
    batch = ["--max_batch_size", "2"]
    for extra in ([], ["--autoregressive"], batch, ["--autoregressive", *batch]):
        out = tmp_path / "device.json"
        args = ["-m", "runner", "--engine_dir", str(demo_engine(2)), "--backend", "torch", "--loop", "device",
                "--max_output_len", "48", "--output_json", str(out), *extra]  # fmt: skip
        for prompt in PROMPTS:
            args += ["--input_text", prompt]
        done = mpirun(2, *args)
        assert done.returncode == 0, done.stderr
        assert [r["output_ids"] for r in json.loads(out.read_text())["results"]] == reference, extra
        assert ("[batch] 2 requests, up to 2 a step" in done.stdout) == ("--max_batch_size" in extra)
    refused = mpirun(2, "-m", "runner", "--engine_dir", str(demo_engine(2)), "--backend", "ort", "--loop", "device",
                     "--input_text", "x")  # fmt: skip
    assert refused.returncode == 2 and "--loop device runs on the torch backend; got --backend ort" in refused.stderr
    refused = mpirun(2, "-m", "runner", "--engine_dir", str(demo_engine(2)), "--backend", "ort", "--max_batch_size",
                     "4", "--input_text", "x")  # fmt: skip
    assert refused.returncode == 2 and "--max_batch_size 4: batched steps run on the device loop" in refused.stderr


def test_sampled_device_steps_under_mpirun_equal_one_rank(demo_engine, demo_ckpt, tmp_path):
    """A sampled request on the device loop: every rank draws the same tokens from the counter-based noise without
    communicating (TP-2 under mpirun gives one in-process rank's tokens for the same seed), and the CLI's
    mode is the device loop."""
    from runner.device.loop import generate_on_device
    from runner.tokenizer import load_tokenizer

    out = tmp_path / "sampled.json"
    done = mpirun(2, "-m", "runner", "--engine_dir", str(demo_engine(2)), "--backend", "torch", "--loop", "device",
                  "--temperature", "0.8", "--top_p", "0.95", "--seed", "7", "--max_output_len", "32",
                  "--end_id", "-1", "--input_text", PROMPTS[0], "--output_json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "mode: DDTree budget 32 (block 8), device loop" in done.stdout
    spec = SpecConfig(8, 32)
    engine = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True)
    prompt = load_tokenizer(demo_engine(2) / "tokenizer", 512).encode(PROMPTS[0])
    expected = generate_on_device(engine, spec, prompt, 32, 512, params=SamplingParams(0.8, 0, 0.95, 7)).tokens
    engine.close()
    assert json.loads(out.read_text())["results"][0]["output_ids"] == expected


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_an_idle_server_does_not_spin(demo_engine):
    """`--serve` waiting for requests: rank 0 blocks on its input and the other ranks sleep between polls for the
    next call (a blocking MPI receive kept one core per rank busy)."""
    engine = demo_engine(2)
    launcher = Path(sys.executable).parent / "mpirun"
    command = [str(launcher), "-np", "2", sys.executable, "-m", "runner", "--serve", "--engine_dir", str(engine),
               "--backend", "ort"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                           cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    try:
        assert json.loads(job.stdout.readline())["event"] == "ready"
        time.sleep(1.0)
        pattern = f"python.* -m runner --serve --engine_dir {engine}"
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        ranks = [int(p) for p in found if int(p) != job.pid]
        assert len(ranks) == 2, found
        before = sum(_cpu_seconds(p) for p in ranks)
        time.sleep(3.0)
        idle = sum(_cpu_seconds(p) for p in ranks) - before
        assert idle < 0.3, f"two idle ranks used {idle:.2f} s of CPU in 3 s"
        job.stdin.write(json.dumps({"id": "after", "text_input": PROMPTS[0], "max_tokens": 4}) + "\n")
        job.stdin.flush()
        event = {}
        while event.get("event") not in ("done", "error"):  # the request after the idle time is served
            event = json.loads(job.stdout.readline())
        assert event["event"] == "done" and event["id"] == "after", event
    finally:
        job.stdin.close()
        assert job.wait(60) == 0


def test_an_aborted_job_leaves_no_shared_memory():
    """A rank that fails aborts the whole job (`run_on_all_ranks`); MPICH's shared-memory segment used to stay in
    /dev/shm after every such job."""
    script = (
        "from runner.mpi import run_on_all_ranks\n"
        "def main(comm):\n"
        "    if comm.Get_rank() == 1:\n"
        "        raise RuntimeError('rank 1 fails')\n"
        "    comm.Barrier()\n"
        "run_on_all_ranks(main)\n"
    )
    before = set(os.listdir("/dev/shm"))
    done = mpirun(2, "-c", script, timeout=120)
    assert done.returncode != 0 and "[rank 1] RuntimeError: rank 1 fails" in done.stderr
    assert "aborting all 2 ranks" in done.stderr
    # left behind: a new segment no live process maps (the job has ended; a segment another test's MPI job made
    # meanwhile is mapped by that job's ranks)
    new = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("mpich_shm_")}
    assert new - shm_mapped_by_live_processes() == set()


def shm_mapped_by_live_processes() -> set[str]:
    """The /dev/shm names some running process has mapped (its /proc/PID/maps)."""
    names = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names.update(line.split("/dev/shm/", 1)[1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line)
    return names


def test_a_job_whose_server_is_gone_ends_at_once(demo_engine):
    """`--serve_parent_pid` (the Triton model passes the server's pid): when that process ends, the job ends within
    a poll instead of finishing its request orphaned. Compared with one whole request of the same job."""
    engine = demo_engine(2)
    parent = subprocess.Popen(["sleep", "600"])
    launcher = Path(sys.executable).parent / "mpirun"
    command = [str(launcher), "-np", "2", sys.executable, "-m", "runner", "--serve", "--engine_dir", str(engine),
               "--backend", "ort", "--serve_parent_pid", str(parent.pid)]  # fmt: skip
    root, env = Path(__file__).resolve().parents[1], dict(os.environ, OMP_NUM_THREADS="1")
    job = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=root)  # fmt: skip
    try:
        assert json.loads(job.stdout.readline())["event"] == "ready"
        long = {"text_input": PROMPTS[1], "max_tokens": 400, "end_id": -1}
        started = time.monotonic()
        job.stdin.write(json.dumps({**long, "id": "whole"}) + "\n")
        job.stdin.flush()
        while json.loads(job.stdout.readline())["event"] != "done":
            pass
        whole = time.monotonic() - started
        job.stdin.write(json.dumps({**long, "id": "orphaned"}) + "\n")
        job.stdin.flush()
        assert json.loads(job.stdout.readline())["event"] == "tokens"
        parent.kill()  # a zombie until reaped: it counts as ended
        started = time.monotonic()
        code = job.wait(120)
        ended = time.monotonic() - started
    finally:
        parent.kill()
        if job.poll() is None:
            job.kill()
    assert code == 3  # the job's own abort (its message may be lost with the aborted ranks' output)
    assert ended < max(whole / 2, 1.0), f"the job ran {ended:.2f} s after its server; a whole request takes {whole:.2f}"


def test_one_engine_runs_every_budget_it_was_built_for(demo_ckpt, reference, tmp_path):
    """`build-engine build --extra_budgets 8,16`: TensorRT-RTX engines with a verify profile per budget; under mpirun
    each budget (and one that fits the chain profile) gives the autoregressive reference's tokens; a budget the
    engine lacks is refused with the budgets it has."""
    from builder.cli import main as build_main

    engine = tmp_path / "multi"
    code = build_main(["build", "--checkpoint_dir", str(demo_ckpt(1)), "--output_dir", str(engine),
                       "--max_input_len", "64", "--max_seq_len", "512", "--ddtree_budget", "32",
                       "--extra_budgets", "8,16"])  # fmt: skip
    assert code == 0
    record = json.loads((engine / "config.json").read_text())
    assert {"verify_tree", "verify_tree_9", "verify_tree_17"} <= set(record["profiles"])
    for budget in ("16", "8", "5"):
        done, out = run(1, engine, tmp_path, "--ddtree_budget", budget)
        assert done.returncode == 0, done.stderr
        assert [r["output_ids"] for r in out["results"]] == reference, budget
        assert f"DDTree budget {budget} (block 8)" in done.stdout
    done, out = run(1, engine, tmp_path, "--ddtree_budget", "auto")  # chosen every step, by measured cost
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert [r["output_ids"] for r in out["results"]] == reference
    assert "budget auto: one step costs 8: " in done.stdout and "DDTree budget auto of [8, 16, 32]" in done.stdout
    assert all(set(r["budgets"]) <= {8, 16, 32} for r in out["results"])
    done, _ = run(1, engine, tmp_path, "--ddtree_budget", "12")
    assert done.returncode == 2 and "the engine verifies tree budgets [8, 16, 32]" in done.stderr


def test_a_rank_aborts_only_once_the_launcher_has_read_its_output():
    """`wait_until_read` returns once the pipe's reader has taken every byte (MPI_Abort then kills the ranks; hydra
    had dropped a traceback still in the pipe), and at once when nothing is unread."""
    import threading

    from runner.mpi import wait_until_read

    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"[rank 1] Traceback ...\n")
        reader = threading.Timer(0.3, lambda: os.read(read_end, 1024))
        started = time.monotonic()
        reader.start()
        wait_until_read((write_end,), limit_s=5.0, settle_s=0.0)
        waited = time.monotonic() - started
        reader.join()
        assert 0.25 < waited < 3.0
        started = time.monotonic()
        wait_until_read((write_end,), limit_s=5.0, settle_s=0.0)
        assert time.monotonic() - started < 0.1
    finally:
        os.close(read_end)
        os.close(write_end)
