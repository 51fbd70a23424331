"""The per-rank torch modules against transformers (target) and a z-lab-structured drafter reference."""

import json

import pytest
import torch
import transformers  # a test dependency: missing, these tests fail (not skip)

from models.loader import load_rank_models
from models.mapping import Mapping
from models.mla import AbsorbedMLA, ExpandedMLA
from models.ops import ModelOps
from models.parallel import SingleRank, ThreadGroup
from plugins.tree_attention.reference import tree_attention

PROMPT = torch.tensor([5, 77, 300, 12, 480, 33, 250, 7, 9, 100, 42, 41])


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hf_model(demo_hf):
    return transformers.DeepseekV3ForCausalLM.from_pretrained(demo_hf / "kimi-k2-tiny", dtype=torch.float32).eval()


MLA_FORMS = {"absorbed": AbsorbedMLA, "expanded": ExpandedMLA}


def _target(ckpt, rank=0, collectives=None, attention="absorbed", fused=False):
    """fused: the GPU forms of the projections (q/k/v and gate/up each one GEMM over a stacked weight), on the CPU."""
    ops = ModelOps(tree_attention, collectives or SingleRank(), mla=MLA_FORMS[attention], fused_projections=fused)
    return load_rank_models(ckpt, rank, ops)


def _prefill_inputs(config, tokens, capacity=64):
    count = len(tokens)
    cache = torch.zeros(config.target.num_hidden_layers, capacity, config.target.latent_dim)
    causal = torch.ones(count, count, dtype=torch.bool).tril()
    return tokens, torch.arange(count), causal, cache, torch.tensor([0]), torch.arange(count)


@pytest.mark.parametrize("attention", ["absorbed", "expanded"])
def test_tp1_target_matches_transformers(hf_model, demo_ckpt, attention):
    config, target, _ = _target(demo_ckpt(1), attention=attention)
    with torch.no_grad():
        hf = hf_model(PROMPT[None], output_hidden_states=True)
        logits, new_kv, taps = target(*_prefill_inputs(config, PROMPT))
    assert rel(logits, hf.logits[0]) < 1e-5
    hidden = config.target.hidden_size
    for slot, layer in enumerate(config.drafter.target_layer_ids):  # taps are the tapped layers' outputs
        assert rel(taps[:, slot * hidden : (slot + 1) * hidden], hf.hidden_states[layer + 1][0]) < 1e-5


@pytest.mark.parametrize("attention", ["absorbed", "expanded"])
def test_tp1_target_step_by_step_matches_transformers(hf_model, demo_ckpt, attention):
    config, target, _ = _target(demo_ckpt(1), attention=attention)
    cache = torch.zeros(config.target.num_hidden_layers, 64, config.target.latent_dim)
    with torch.no_grad():
        reference = hf_model(PROMPT[None]).logits[0]
        _, kv, _ = target(
            PROMPT[:5],
            torch.arange(5),
            torch.ones(5, 5, dtype=torch.bool).tril(),
            cache,
            torch.tensor([0]),
            torch.arange(5),
        )
        cache[:, :5] = kv
        for t in range(5, len(PROMPT)):
            logits, kv, _ = target(
                PROMPT[t : t + 1],
                torch.tensor([t]),
                torch.ones(1, 1, dtype=torch.bool),
                cache,
                torch.tensor([t]),
                torch.tensor([0]),
            )
            cache[:, t : t + 1] = kv
            assert rel(logits[0], reference[t]) < 1e-5


def _run_ranks(ckpt, tp_size, fn):
    import concurrent.futures

    group = ThreadGroup(tp_size)
    with concurrent.futures.ThreadPoolExecutor(tp_size) as pool:
        return list(pool.map(lambda r: fn(r, group.member(r)), range(tp_size)))


@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_tp_ranks_match_tp1(demo_ckpt, tp_size):
    config, target, drafter = _target(demo_ckpt(1))
    tree_mask = torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).tril()
    draft_inputs = _draft_inputs(config, seed=1)
    with torch.no_grad():
        reference = target(*_prefill_inputs(config, PROMPT))
        draft_reference = drafter(*draft_inputs(config.drafter.num_key_value_heads))

    def rank(r, collectives):
        cfg, t, d = _target(demo_ckpt(tp_size), r, collectives)
        with torch.no_grad():
            return t(*_prefill_inputs(cfg, PROMPT)), d(*draft_inputs(cfg.drafter.kv_heads_per_rank, r, tp_size))

    results = _run_ranks(demo_ckpt(tp_size), tp_size, rank)
    for (logits, new_kv, taps), _ in results:  # every rank holds the same gathered logits and replicated latents
        assert rel(logits, reference[0]) < 1e-5 and rel(new_kv, reference[1]) < 1e-5 and rel(taps, reference[2]) < 1e-5
    assert tree_mask.shape[0] == len(PROMPT)
    for _, (draft_logits, _) in results:
        assert rel(draft_logits, draft_reference[0]) < 1e-5
    context_kv = torch.cat([r[1][1] for r in results], dim=3)  # kv heads split across ranks
    assert rel(context_kv, draft_reference[1]) < 1e-5


@pytest.mark.parametrize("fused", [False, True])
def test_context_kv_is_the_context_rows_of_a_draft(demo_ckpt, fused):
    """`context_kv` (the device loop commits a prompt's context with it) gives the K/V rows a draft returns for the
    same context, and drafting after committing them gives the draft of the longer context (fused: the GPU forms of
    the projections, on the CPU)."""
    config, _, drafter = _target(demo_ckpt(1), fused=fused)
    d = config.drafter
    context, positions, _, block, block_positions, cache, cache_length = _draft_inputs(config, seed=2)(
        d.num_key_value_heads
    )
    with torch.no_grad():
        logits, new_kv = drafter(context, positions, torch.tensor([8]), block, block_positions, cache, cache_length)
        kv = drafter.context_kv(context, positions)
        assert kv.shape == new_kv.shape and rel(kv, new_kv) < 1e-6
        committed = cache.clone()
        committed[:, :, 10:18] = kv
        after, _ = drafter(torch.zeros_like(context), positions, torch.tensor([0]), block, block_positions,
                           committed, torch.tensor([18]))  # fmt: skip
    assert rel(after, logits) < 1e-5


def _draft_inputs(config, seed):
    """Draft inputs with a non-empty draft cache, 3 valid context rows of 8, and a block of 8."""
    gen = torch.Generator().manual_seed(seed)
    d, hidden = config.drafter, config.target.hidden_size
    context = torch.randn(8, d.num_taps * hidden, generator=gen)
    full_cache = torch.randn(d.num_hidden_layers, 2, 32, d.num_key_value_heads, d.head_dim, generator=gen)

    def make(kv_heads, rank=0, tp=1):
        cache = full_cache[:, :, :, rank * kv_heads : (rank + 1) * kv_heads].contiguous()
        block = torch.tensor([17] + [d.mask_token_id] * 7)
        return (
            context,
            torch.arange(10, 18),
            torch.tensor([3]),
            block,
            torch.arange(13, 21),
            cache,
            torch.tensor([10]),
        )

    return make


@pytest.mark.parametrize("fused", [False, True])
def test_drafter_matches_zlab_structured_reference(demo_hf, demo_ckpt, fused):
    """An independent implementation from transformers' Qwen3 blocks, following z-lab dflash/model.py. fused: the
    GPU forms of the projections, here on the CPU: q/k/v and gate/up each one GEMM over a stacked weight (the GPU
    attention kernel in the drafter: tests/test_draft_attention.py)."""
    from safetensors.torch import load_file
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

    config, _, drafter = _target(demo_ckpt(1), fused=fused)
    raw = json.loads((demo_hf / "kimi-k2-tiny-dflash" / "config.json").read_text())
    qcfg = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "dflash_config")})
    w = load_file(str(demo_hf / "kimi-k2-tiny-dflash" / "model.safetensors"))
    t = load_file(str(demo_hf / "kimi-k2-tiny" / "model.safetensors"))
    d, hd = config.drafter, config.drafter.head_dim
    rotary = Qwen3RotaryEmbedding(qcfg)

    def norm(x, name):
        n = Qwen3RMSNorm(x.shape[-1], eps=qcfg.rms_norm_eps)
        n.weight.data = w[name]
        return n(x)

    def rope(x, cos, sin):  # x [B, heads, S, hd], cos [B, S, hd]
        return x * cos[:, None] + rotate_half(x) * sin[:, None]

    # one draft call after a previous call: context rows 10..12 are new, cache holds rows 0..9 (random K/V)
    gen = torch.Generator().manual_seed(1)
    context = torch.randn(8, d.num_taps * config.target.hidden_size, generator=gen)[:3]
    cache = torch.randn(d.num_hidden_layers, 2, 32, d.num_key_value_heads, hd, generator=gen)[:, :, :10]
    block = torch.tensor([17] + [d.mask_token_id] * 7)
    with torch.no_grad():
        ctx = norm(context @ w["fc.weight"].T, "hidden_norm.weight")[None]
        h = t["model.embed_tokens.weight"][block][None]
        cos, sin = rotary(h, torch.arange(10, 21)[None])
        for i in range(d.num_hidden_layers):
            p = f"layers.{i}."
            x = norm(h, p + "input_layernorm.weight")
            q = norm((x @ w[p + "self_attn.q_proj.weight"].T).view(1, 8, -1, hd), p + "self_attn.q_norm.weight")
            k = torch.cat([ctx, x], 1) @ w[p + "self_attn.k_proj.weight"].T
            v = torch.cat([ctx, x], 1) @ w[p + "self_attn.v_proj.weight"].T
            k = norm(k.view(1, 11, -1, hd), p + "self_attn.k_norm.weight").transpose(1, 2)
            v = v.view(1, 11, -1, hd).transpose(1, 2)
            q = rope(q.transpose(1, 2), cos[:, -8:], sin[:, -8:])
            k = rope(k, cos, sin)
            k = torch.cat([cache[i, 0].transpose(0, 1)[None], k], 2)
            v = torch.cat([cache[i, 1].transpose(0, 1)[None], v], 2)
            groups = d.num_attention_heads // d.num_key_value_heads
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            attn = torch.softmax(q @ k.transpose(2, 3) * hd**-0.5, -1) @ v
            h = h + attn.transpose(1, 2).reshape(1, 8, -1) @ w[p + "self_attn.o_proj.weight"].T
            x = norm(h, p + "post_attention_layernorm.weight")
            mlp = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
            h = h + mlp @ w[p + "mlp.down_proj.weight"].T
        reference = norm(h, "norm.weight")[0, 1:] @ t["lm_head.weight"].T
        padded_context = torch.cat([context, torch.zeros(5, context.shape[1])])  # rows >= context_length ignored
        padded_cache = torch.cat([cache, torch.randn(*cache.shape[:2], 22, *cache.shape[3:])], 2)
        logits, new_kv = drafter(
            padded_context,
            torch.arange(10, 18),
            torch.tensor([3]),
            block,
            torch.arange(13, 21),
            padded_cache,
            torch.tensor([10]),
        )
    assert logits.shape == (7, config.target.vocab_size)
    assert rel(logits, reference) < 1e-5
    assert new_kv.shape == (d.num_hidden_layers, 2, 8, d.num_key_value_heads, hd)


def test_yarn_rope_matches_transformers(demo_hf):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3RotaryEmbedding

    from models.config import DrafterConfig
    from models.rope import Rotary

    raw = json.loads((demo_hf / "kimi-k2-tiny-dflash" / "config.json").read_text())
    ours = Rotary(DrafterConfig.from_hf(raw).rope, raw["head_dim"])
    theirs = Qwen3RotaryEmbedding(Qwen3Config(**{k: v for k, v in raw.items() if k != "dflash_config"}))
    positions = torch.arange(0, 2000, 37)
    cos, sin = theirs(torch.zeros(1), positions[None])
    assert torch.allclose(ours(positions, torch.float32)[0], cos[0], atol=1e-6)
    assert torch.allclose(ours(positions, torch.float32)[1], sin[0], atol=1e-6)


def test_a_drafter_with_fewer_kv_heads_than_ranks_runs_replicated(demo_hf, tmp_path):
    """A 2-KV-head drafter at TP-8 (was refused: "tp_size=8 must divide num_key_value_heads=2"): each K/V head lives
    on 4 ranks, and every rank's draft logits and context K/V equal TP-1's."""
    from safetensors.torch import save_file

    from builder.convert import convert
    from builder.demo_checkpoints import drafter_hf_config, random_tensors
    from models.config import DrafterConfig
    from models.layout import hf_drafter_specs

    hf = tmp_path / "drafter-2kv"
    hf.mkdir()
    raw = {**drafter_hf_config(), "num_key_value_heads": 2}
    (hf / "config.json").write_text(json.dumps(raw))
    save_file(random_tensors(hf_drafter_specs(DrafterConfig.from_hf(raw)), seed=11), str(hf / "model.safetensors"))
    ckpts = {tp: tmp_path / f"tp{tp}" for tp in (1, 8)}
    for tp, out in ckpts.items():
        convert(demo_hf / "kimi-k2-tiny", hf, out, tp)
    config, _, drafter = _target(ckpts[1])
    make = _draft_inputs(config, seed=3)
    full = make(2)
    with torch.no_grad():
        want_logits, want_kv = drafter(*full)

    def rank(r, collectives):
        cfg, _, d = _target(ckpts[8], r, collectives)
        assert cfg.drafter.kv_heads_per_rank == 1
        head = r // 4
        inputs = list(full)
        inputs[5] = full[5][:, :, :, head : head + 1].contiguous()  # the rank's K/V head of the draft cache
        with torch.no_grad():
            return d(*inputs)

    for r, (logits, kv) in enumerate(_run_ranks(ckpts[8], 8, rank)):
        assert rel(logits, want_logits) < 1e-5
        assert rel(kv, want_kv[:, :, :, r // 4 : r // 4 + 1]) < 1e-5
    with pytest.raises(ValueError, match="tp_size=4 must divide drafter num_key_value_heads=3, or be a multiple of it"):
        DrafterConfig.from_hf({**raw, "num_key_value_heads": 3, "num_attention_heads": 12}, Mapping(4, 0, 4))
