"""The rank factory (runner/factory.py): one place makes the hardware choices, and the GPU forms it picks compute
what the reference forms compute (under the Triton interpreter, on the CPU)."""

import pytest
import torch

from engines.spec import BuildConfig, SpecConfig
from models.dflash import DraftAttention, KernelDraftAttention
from models.layers import FusedRMSNorm, RMSNorm
from models.mla import AbsorbedMLA, InPlaceAbsorbedMLA
from models.moe import GroupedMoE, MoE
from models.parallel import SingleRank
from models.presets import preset
from runner.factory import CheckpointWeights, PresetWeights, RankOptions, build_rank, cpu_ops, gpu_ops, local_ranks
from runner.generator import Generator
from runner.sampling import SamplingParams
from tests.interpreter import run_interpreted

BUILD = BuildConfig(max_input_len=64, max_seq_len=512)


def test_options_are_validated():
    with pytest.raises(ValueError, match="backend must be one of"):
        RankOptions("tensorrt")
    with pytest.raises(ValueError, match="device must be one of"):
        RankOptions(device="gpu")
    with pytest.raises(ValueError, match="the device loop runs on the torch backend; got backend='ort'"):
        RankOptions("ort", device_loop=True)


def test_weights_without_an_engine_directory_need_the_torch_backend_and_a_spec(demo_ckpt):
    weights = CheckpointWeights(demo_ckpt(1))
    with pytest.raises(ValueError, match="the ort backend runs an engine directory; got CheckpointWeights"):
        build_rank(weights, 0, RankOptions("ort"), SpecConfig(8, 32), BUILD)
    with pytest.raises(ValueError, match="need a spec and a build config"):
        build_rank(weights, 0, RankOptions(device="cpu"))
    with pytest.raises(ValueError, match="tp_size=2 needs its ranks: run under mpirun -np 2"):
        build_rank(CheckpointWeights(demo_ckpt(2)), 0, RankOptions(device="cpu"), SpecConfig(8, 32), BUILD)


def test_the_forms_are_chosen_by_device_and_dtype():
    target = preset("moe").target
    reference = cpu_ops(SingleRank())
    assert (reference.mla, reference.moe, reference.norm, reference.draft_attention) == (
        AbsorbedMLA, MoE, RMSNorm, DraftAttention)  # fmt: skip
    assert not reference.fused_projections
    bf16, fp32 = gpu_ops(SingleRank(), target, torch.bfloat16), gpu_ops(SingleRank(), target, torch.float32)
    assert (bf16.mla, bf16.norm, bf16.draft_attention) == (InPlaceAbsorbedMLA, FusedRMSNorm, KernelDraftAttention)
    assert bf16.moe is GroupedMoE and fp32.moe is MoE  # torch._grouped_mm is bf16 only
    assert bf16.fused_projections


def test_the_bf16_experts_route_in_one_launch_only_when_asked(monkeypatch):
    """`DDTREE_MOE_ROUTE=kernel` takes `RoutedGroupedMoE` for bf16 experts (float32 keeps the gathered form); unset
    or "sort", the `argsort` form; any other value is an error that names the variable, the choices and the value."""
    from models.moe import RoutedGroupedMoE

    target = preset("moe").target
    for value, form in (("kernel", RoutedGroupedMoE), ("sort", GroupedMoE), ("", GroupedMoE)):
        monkeypatch.setenv("DDTREE_MOE_ROUTE", value)
        assert gpu_ops(SingleRank(), target, torch.bfloat16).moe is form
        assert gpu_ops(SingleRank(), target, torch.float32).moe is MoE
    monkeypatch.setenv("DDTREE_MOE_ROUTE", "radix")
    with pytest.raises(
        ValueError, match=r"DDTREE_MOE_ROUTE: expected 'sort' or 'kernel' \(or unset: sort\), got 'radix'"
    ):
        gpu_ops(SingleRank(), target, torch.bfloat16)


def test_the_routers_kernels_take_a_batchs_rows_unless_told_fewer(monkeypatch):
    """The GPU router's kernels take up to ROUTER_MAX_TOKENS rows (a batch's verify), or `DDTREE_ROUTER_MAX_ROWS`
    (then more rows take the torch form; the same class for the same limit); a limit that is not a row count from 1
    to ROUTER_MAX_TOKENS is an error that names the variable, the range and the value."""
    from models.moe import FusedRouter
    from models.triton_ops import ROUTER_MAX_TOKENS

    target = preset("moe").target
    monkeypatch.delenv("DDTREE_ROUTER_MAX_ROWS", raising=False)
    assert gpu_ops(SingleRank(), target, torch.bfloat16).router is FusedRouter
    monkeypatch.setenv("DDTREE_ROUTER_MAX_ROWS", "64")
    router = gpu_ops(SingleRank(), target, torch.bfloat16).router
    assert issubclass(router, FusedRouter) and router.max_rows == 64
    assert gpu_ops(SingleRank(), target, torch.bfloat16).router is router
    gen = torch.Generator().manual_seed(0)
    fused, limited = FusedRouter(target), router(target)
    for module in (fused, limited):
        module.weight.data = (torch.randn(module.weight.shape, generator=gen) * 0.05).to(torch.bfloat16).float()
        module.prepare_weights()
    x = torch.randn(65, target.hidden_size, generator=gen).to(torch.bfloat16)
    calls = []
    import models.triton_ops

    monkeypatch.setattr(models.triton_ops, "route_top_k", lambda *a, **k: calls.append(a[0].shape[0]) or (None, None))
    fused(x[:65]), limited(x[:64]), limited(x[:65])  # the last one: the torch form
    assert calls == [65, 64], calls
    for value in ("0", f"{ROUTER_MAX_TOKENS + 1}", "many"):
        monkeypatch.setenv("DDTREE_ROUTER_MAX_ROWS", value)
        with pytest.raises(
            ValueError,
            match=rf"DDTREE_ROUTER_MAX_ROWS: expected a row count from 1 to "
            rf"{ROUTER_MAX_TOKENS} \(or unset: {ROUTER_MAX_TOKENS}\), got '{value}'",
        ):
            gpu_ops(SingleRank(), target, torch.bfloat16)


def test_the_experts_routed_in_one_launch_equal_the_sorted_form_under_the_interpreter():
    """`RoutedGroupedMoE` (the pairs sorted by the INT4 experts' routing program, run by the Triton interpreter)
    gives `GroupedMoE`'s outputs bit for bit on the same bf16 weights: at 1 and 33 tokens, and past the routing
    program's pairs (its own sort then)."""
    done = run_interpreted("""
        import torch
        from models.layout import rank_target_shapes
        from models.moe import GroupedMoE, RoutedGroupedMoE
        from models.parallel import SingleRank
        from models.presets import preset
        from models.random_weights import random_state, router_in_fp32
        from plugins.int4_moe.kernel import ROUTE_MAX_PAIRS
        from runner.factory import cpu_ops
        import dataclasses
        # 16 experts, top 4: experts that no token chose, and others that several did
        config = dataclasses.replace(preset("moe", smoke=True).target, n_routed_experts=16, num_experts_per_tok=4)
        prefix = "model.layers.1.mlp."
        shapes = {k[len(prefix) :]: v for k, v in rank_target_shapes(config).items() if k.startswith(prefix)}
        state = router_in_fp32(random_state(shapes, seed=4, dtype=torch.bfloat16))
        forms = []
        for form in (GroupedMoE, RoutedGroupedMoE):
            with torch.device("meta"):
                moe = form(config, 1, cpu_ops(SingleRank()))
            moe.load_state_dict(state, strict=True, assign=True)
            forms.append(moe)
        past = ROUTE_MAX_PAIRS // config.num_experts_per_tok + 1
        for tokens in (1, 33, past):
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, config.hidden_size, generator=gen).to(torch.bfloat16)
            with torch.no_grad():
                want, got = (moe(x) for moe in forms)
                ids = forms[0].gate(x)[0]
            assert torch.equal(got, want), tokens
            assert tokens == 1 or len(set(torch.bincount(ids.flatten(), minlength=16).tolist())) > 2, tokens
        print("ok")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "ok"


def test_local_ranks_on_the_cpu_run_every_rank_with_the_reference_forms(demo_ckpt):
    ranks = local_ranks(CheckpointWeights(demo_ckpt(2)), RankOptions(device="cpu"), SpecConfig(8, 32), BUILD)
    assert len(ranks.workers) == 2 and ranks.lead is ranks.workers[0]
    assert ranks.lead.loop is None  # the device loop is on by default only on CUDA
    forms = "torch backend on cpu: tree_attention, AbsorbedMLA, DenseMoE, RMSNorm, DraftAttention"
    assert forms in ranks.lead.description
    generator = Generator(ranks)
    assert generator.mode() == "DDTree budget 32 (block 8), host loop"
    assert generator.warm_up() > 0
    ranks.close()


def test_generator_takes_the_device_loop_unless_tokens_are_banned(demo_ckpt):
    ranks = local_ranks(CheckpointWeights(demo_ckpt(1)), RankOptions(device="cpu", device_loop=True),
                        SpecConfig(8, 7, 1), BUILD)  # fmt: skip
    generator = Generator(ranks)
    assert generator.mode() == "DFlash chain (block 8), device loop (eager tensor program)"
    assert generator.mode(SamplingParams(0.7)) == "DFlash chain (block 8), device loop (eager tensor program)"
    assert generator.mode(banned=(3,)) == "DFlash chain (block 8), host loop"  # bad_words: the host loop's sampler
    greedy = generator.generate([5, 77, 300], 20)
    assert len(greedy.tokens) == 20 and greedy.decode_tokens_per_s > 0
    with pytest.raises(ValueError, match="the ranks' device loop is speculative; this generator is autoregressive"):
        Generator(ranks, autoregressive=True)
    ranks.close()


def test_preset_weights_are_shared_by_ranks_built_again():
    weights = PresetWeights("moe", torch.float32, smoke=True)
    first = local_ranks(weights, RankOptions(device="cpu"), SpecConfig(8, 32), BUILD)
    again = local_ranks(weights, RankOptions(device="cpu", device_loop=True), SpecConfig(8, 7, 1), BUILD)
    assert first.lead.session.modules["target"] is again.lead.session.modules["target"]
    standalone = PresetWeights("kimi-rank", torch.float32, smoke=True)
    assert standalone.tp_size == 1 and standalone.rank_configs(0)[0].mapping.tp_size == 2  # one rank's share, alone
    first.close()
    again.close()


def test_gpu_forms_equal_the_reference_forms_under_the_interpreter(demo_ckpt):
    """The forms `gpu_ops` picks (TreeAttention and drafter kernels, in-place MLA, fused norm / rotary / projections),
    run on the CPU by the Triton interpreter, give the reference forms' logits, latent rows and draft K/V on the tiny
    checkpoint in float32: a prefill, a tree verify and a draft."""
    done = run_interpreted(
        f"""
        import torch
        from models.parallel import SingleRank
        from runner.factory import CheckpointWeights, cpu_ops, gpu_ops
        weights = CheckpointWeights({str(demo_ckpt(1))!r})
        target_cfg, drafter_cfg = weights.rank_configs(0)
        cpu = torch.device("cpu")
        reference = weights.models(0, cpu_ops(SingleRank()), cpu)
        forms = weights.models(0, gpu_ops(SingleRank(), target_cfg, torch.float32), cpu)
        assert type(forms[0].model.layers[0].self_attn).__name__ == "InPlaceAbsorbedMLA"
        gen = torch.Generator().manual_seed(3)
        cache = torch.randn(target_cfg.num_hidden_layers, 64, target_cfg.latent_dim, generator=gen)
        tree = torch.eye(9, dtype=torch.bool)
        for node, parent in enumerate([0, 0, 1, 1, 2, 4, 0, 6], start=1):
            tree[node] |= tree[parent]
        ids = torch.randint(0, 400, (9,), generator=gen)
        target_calls = [
            (ids[:5], torch.arange(5), torch.ones(5, 5, dtype=torch.bool).tril(), cache, torch.tensor([0]),
             torch.arange(5)),
            (ids, 20 + tree.sum(-1) - 1, tree, cache, torch.tensor([20]), torch.arange(9)),
        ]
        taps = torch.randn(8, drafter_cfg.num_taps * target_cfg.hidden_size, generator=gen)
        draft_cache = torch.randn(drafter_cfg.num_hidden_layers, 2, 64, drafter_cfg.kv_heads_per_rank,
                                  drafter_cfg.head_dim, generator=gen)
        block = torch.tensor([17] + [drafter_cfg.mask_token_id] * 7)
        draft_call = (taps, torch.arange(12, 20), torch.tensor([3]), block, torch.arange(15, 23), draft_cache,
                      torch.tensor([12]))
        worst = 0.0
        with torch.no_grad():
            for call in target_calls:
                for want, got in zip(reference[0](*call), forms[0](*call)):
                    worst = max(worst, float((got - want).norm() / want.norm()))
            for want, got in zip(reference[1](*draft_call), forms[1](*draft_call)):
                worst = max(worst, float((got - want).norm() / want.norm()))
        print("worst", worst)
    """,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < 1e-5


def test_grouped_moe_equals_the_gathered_moe_in_bf16():
    """The GPU MoE (tokens sorted by expert, one grouped GEMM a projection, the top-k outputs summed per token in a
    fixed order) against the gathered (exported) form on the same bf16 weights; torch._grouped_mm runs on the CPU."""
    from models.layout import rank_target_shapes
    from models.random_weights import random_state, router_in_fp32

    config = preset("moe", smoke=True).target
    prefix = "model.layers.1.mlp."
    shapes = {k[len(prefix) :]: v for k, v in rank_target_shapes(config).items() if k.startswith(prefix)}
    state = router_in_fp32(random_state(shapes, seed=4, dtype=torch.bfloat16))
    with torch.device("meta"):
        grouped = GroupedMoE(config, 1, cpu_ops(SingleRank()))
    grouped.load_state_dict(state, strict=True, assign=True)
    x = torch.randn(33, config.hidden_size, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        got, want = grouped(x).float(), MoE.forward(grouped, x).float()
    assert float((got - want).norm() / want.norm()) < 1e-2


def test_dense_moe_equals_the_gathered_moe_and_is_chosen_for_few_experts():
    """The CPU form for few experts (every expert on every token, weighted by the sparse top-k weights) against the
    gathered form on the same float32 weights, at 1 and 33 tokens; `moe_form` picks it only while E <= 4 k."""
    from models.layout import rank_target_shapes
    from models.moe import DenseMoE, moe_form
    from models.random_weights import random_state, router_in_fp32

    config = preset("moe", smoke=True).target  # 8 experts, top-8
    prefix = "model.layers.1.mlp."
    shapes = {k[len(prefix) :]: v for k, v in rank_target_shapes(config).items() if k.startswith(prefix)}
    state = router_in_fp32(random_state(shapes, seed=6))
    with torch.device("meta"):
        dense = DenseMoE(config, 1, cpu_ops(SingleRank()))
    dense.load_state_dict(state, strict=True, assign=True)
    for tokens in (1, 33):
        x = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            got, want = dense(x), MoE.forward(dense, x)
        assert float((got - want).norm() / want.norm()) < 1e-5
    assert moe_form(config) is DenseMoE and moe_form(preset("kimi-rank-int4").target) is MoE


def test_a_poison_request_fails_only_itself(demo_ckpt, demo_engine):
    """`--serve` (the Triton model's runner): a request whose temperature would turn the sampler's probabilities into
    NaN gets its own error between two good requests, which are served."""
    import io
    import json

    from engines.engine_dir import load_engine_dir
    from runner.serving.serve import serve
    from runner.tokenizer import load_tokenizer

    engine = load_engine_dir(demo_engine(2))
    generator = Generator(local_ranks(CheckpointWeights(demo_ckpt(1)), RankOptions(device="cpu"), engine.spec, BUILD))
    tokenizer = load_tokenizer(engine.tokenizer_dir, 512)
    good = {"text_input": "Hello", "max_tokens": 6}
    requests = [{**good, "id": "a"}, {**good, "id": "b", "temperature": 1e-40}, {**good, "id": "c", "temperature": 0.7}]
    lines = (
        "\n".join(json.dumps(r) for r in requests) + '\n{"id": "d", "text_input": "x", "max_tokens": 2, "top_p": NaN}\n'
    )
    out = io.StringIO()
    serve(generator, tokenizer, engine, engine.spec, "torch", inp=io.StringIO(lines), out=out)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    finals = {e["id"]: e for e in events if e.get("event") in ("done", "error")}
    assert finals["a"]["event"] == "done" and finals["c"]["event"] == "done" and len(finals["c"]["output_ids"]) == 6
    assert (
        finals["b"]["event"] == "error" and "temperature must be 0 (greedy) or at least 1e-05" in finals["b"]["error"]
    )
    assert finals["d"]["event"] == "error" and "top_p must be in (0, 1]" in finals["d"]["error"]
    generator.ranks.close()


def test_serve_cancels_a_request_and_serves_the_next(demo_ckpt, demo_engine):
    """`{"cancel": id}` (what the Triton model sends when a client goes away) stops that request, queued or running,
    and the request after it is served."""
    import io
    import json

    from engines.engine_dir import load_engine_dir
    from runner.serving.serve import serve
    from runner.tokenizer import load_tokenizer

    engine = load_engine_dir(demo_engine(2))
    generator = Generator(local_ranks(CheckpointWeights(demo_ckpt(1)), RankOptions(device="cpu"), engine.spec, BUILD))
    tokenizer = load_tokenizer(engine.tokenizer_dir, 512)
    lines = [
        {"id": "long", "text_input": "Hello", "max_tokens": 400, "end_id": -1},
        {"cancel": "long"},
        {"id": "next", "text_input": "Hello", "max_tokens": 5},
    ]
    inp, out = io.StringIO("\n".join(map(json.dumps, lines))), io.StringIO()
    serve(generator, tokenizer, engine, engine.spec, "torch", inp=inp, out=out)
    events = [json.loads(line) for line in out.getvalue().splitlines()][1:]
    finals = {e["id"]: e for e in events if e["event"] not in ("tokens",)}
    assert finals["long"]["event"] == "cancelled" and len(finals["long"]["output_ids"]) < 400
    assert finals["next"]["event"] == "done" and len(finals["next"]["output_ids"]) == 5
    generator.ranks.close()


def test_a_huge_prompt_is_refused_before_it_is_tokenized(demo_engine):
    import time

    from engines.engine_dir import load_engine_dir
    from runner.tokenizer import encode_prompt, load_tokenizer

    engine = load_engine_dir(demo_engine(2))
    tokenizer = load_tokenizer(engine.tokenizer_dir, 512)
    assert encode_prompt(tokenizer, "Hello world", 64) == tokenizer.encode("Hello world")
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"prompt of 67108864 bytes is at least \d+ tokens, longer than the engine's"):
        encode_prompt(tokenizer, "x" * (64 << 20), 64)  # tokenizing it took tens of seconds
    assert time.perf_counter() - started < tokenizer_seconds(tokenizer, "x" * (1 << 20))


def tokenizer_seconds(tokenizer, text: str) -> float:
    """How long tokenizing `text` takes here: the refusal of a 64x longer text must take less."""
    import time

    started = time.perf_counter()
    tokenizer.encode(text)
    return time.perf_counter() - started


def test_the_gpu_warm_up_prefills_every_range_of_prompt_lengths():
    """`length_buckets`: each power of two and one and a half times it up to the longest prefill, and the longest."""
    from runner.sessions.base import length_buckets

    assert length_buckets(128) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    assert length_buckets(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert length_buckets(1) == [1]
