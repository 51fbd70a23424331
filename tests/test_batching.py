"""Batched steps (several requests in one step): the target's forward over several requests' trees equals one
forward per request, and requests that join and leave a batch on the device loop get autoregressive decoding's
tokens each."""

from __future__ import annotations

import pytest
import torch

from engines.spec import BuildConfig, SpecConfig
from runner.device.tree import ancestor_mask
from tests.conftest import ENGINE_LIMITS, cpu_ranks
from tests.interpreter import run_interpreted


def random_tree(rows: int, gen: torch.Generator):
    """A random tree of `rows` nodes, parents first, with its ancestor mask and depths."""
    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, rows)])
    depths = torch.zeros(rows, dtype=torch.long)
    for i in range(1, rows):
        depths[i] = depths[parents[i]] + 1
    return ancestor_mask(parents, torch.ones(rows, dtype=torch.bool), rows), depths


@pytest.mark.parametrize("tp_size", [1, 2])
def test_one_forward_over_several_requests_equals_a_forward_each(demo_ckpt, tp_size):
    """Three requests with caches of different lengths and different trees: logits, new latent rows and taps of the
    batched forward equal the per-request forwards (every rank alike)."""
    spec = SpecConfig(8, 16)
    ranks = cpu_ranks(demo_ckpt(tp_size), spec, BuildConfig(**ENGINE_LIMITS))
    gen = torch.Generator().manual_seed(0)
    rows, lengths = 17, [5, 40, 23]
    workers = ranks.workers
    target0 = workers[0].session.modules["target"]
    shape = (target0.config.num_hidden_layers, 64, target0.config.latent_dim)
    caches = [torch.randn(shape, generator=gen) for _ in lengths]
    trees = [random_tree(rows, gen) for _ in lengths]
    tokens = torch.randint(0, 200, (len(lengths) * rows,), generator=gen)
    positions = torch.cat([length + depths for length, (_, depths) in zip(lengths, trees)])
    masks = torch.stack([mask for mask, _ in trees])

    def on_every_rank(fn):
        with torch.no_grad():
            return ranks._pool.map(fn, workers) if ranks._pool else [fn(workers[0])]

    def batched(worker):
        return worker.session.modules["target"](tokens, positions, masks, torch.stack(caches), torch.tensor(lengths),
                                                torch.arange(len(tokens)))  # fmt: skip

    def single(worker):
        target = worker.session.modules["target"]
        return [target(tokens[b * rows : (b + 1) * rows], positions[b * rows : (b + 1) * rows], masks[b], caches[b],
                       torch.tensor([lengths[b]]), torch.arange(rows)) for b in range(len(lengths))]  # fmt: skip

    together = list(on_every_rank(batched))
    apart = list(on_every_rank(single))
    ranks.close()
    for got, each in zip(together, apart):
        logits, new_kv, taps = got
        torch.testing.assert_close(logits, torch.cat([e[0] for e in each]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_kv, torch.cat([e[1] for e in each], dim=1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(taps, torch.cat([e[2] for e in each]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_one_drafter_forward_over_several_requests_equals_a_forward_each(demo_ckpt, tp_size):
    """Three requests' blocks with draft caches of different lengths and different counts of new context rows:
    the batched drafter's logits and new context K/V equal the per-request forwards."""
    spec = SpecConfig(8, 16)
    ranks = cpu_ranks(demo_ckpt(tp_size), spec, BuildConfig(**ENGINE_LIMITS))
    gen = torch.Generator().manual_seed(1)
    block, lengths, counts = 8, [3, 40, 17], [8, 1, 5]
    workers = ranks.workers
    drafter0 = workers[0].session.modules["draft"]
    width = drafter0.fc.weight.shape[1]
    shape = workers[0].cache.draft.shape
    caches = [torch.randn(shape, generator=gen) for _ in lengths]
    context = torch.randn(len(lengths) * block, width, generator=gen)
    context_positions = torch.cat([torch.arange(n - c, n - c + block) for n, c in zip(lengths, counts)])
    ids = torch.randint(0, 200, (len(lengths) * block,), generator=gen)
    positions = torch.cat([torch.arange(n, n + block) for n in lengths])

    def batched(worker):
        return worker.session.modules["draft"](context, context_positions, torch.tensor(counts), ids, positions,
                                               torch.stack(caches), torch.tensor(lengths))  # fmt: skip

    def single(worker):
        draft = worker.session.modules["draft"]
        rows = lambda b: slice(b * block, (b + 1) * block)  # noqa: E731
        return [draft(context[rows(b)], context_positions[rows(b)], torch.tensor([counts[b]]), ids[rows(b)],
                      positions[rows(b)], caches[b], torch.tensor([lengths[b]]))
                for b in range(len(lengths))]  # fmt: skip

    with torch.no_grad():
        together = list(ranks._pool.map(batched, workers)) if ranks._pool else [batched(workers[0])]
        apart = list(ranks._pool.map(single, workers)) if ranks._pool else [single(workers[0])]
    ranks.close()
    for (logits, new_kv), each in zip(together, apart):
        torch.testing.assert_close(logits, torch.cat([e[0] for e in each]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_kv, torch.cat([e[1] for e in each], dim=2), rtol=1e-5, atol=1e-5)


PROMPTS = [[5, 77, 300, 12, 480, 33, 250], [200, 201, 9, 88, 17, 400, 402, 300, 11, 63, 5], list(range(40, 440, 11)),
           [7, 7, 7, 90]]  # fmt: skip


def run_batch(ranks, requests, slots):
    """Requests (prompt, max tokens, params, budget) through a `Batcher`: each joins when a slot is free, at the
    next step, those that free slots take admitted together (their prefills in one forward); returns each request's
    result, in request order, the steps' batch sizes and the requests moved into a lower slot."""
    from runner.device.batch import Admission, Batcher

    batcher, results = Batcher(ranks, slots), {}
    waiting = [Admission(prompt, tokens, params, budget=budget, tag=index)
               for index, (prompt, tokens, params, budget) in enumerate(requests)]  # fmt: skip
    while waiting or batcher.members:
        admitted, waiting = waiting[: batcher.free], waiting[batcher.free :]
        for member in batcher.admit_many(admitted):
            if member.result.elapsed:
                results[member.tag] = member.result
        for member in batcher.step():
            results[member.tag] = member.result
    return [results[i] for i in range(len(requests))], batcher.batch_sizes, batcher.moves


@pytest.mark.parametrize("tp_size", [1, 2])
def test_prompts_admitted_together_prefill_as_each_alone(demo_ckpt, tp_size):
    """Four prompts of different lengths into four slots at once, in one forward (with a prefill chunk of 200 rows;
    with 24, a group of two, a prompt of 37 tokens alone in chunks, one alone): every prompt's last-row logits, its
    slot's latent rows and its drafter's context rows equal a prefill of its own, on every rank."""
    spec = SpecConfig(8, 16)
    ranks = cpu_ranks(demo_ckpt(tp_size), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=4)
    slots = [2, 0, 3, 1]

    def caches():
        out = []
        for worker in ranks.workers:
            batch = worker.batch
            out.append([(batch.latent[s, :, : len(p)].clone(), batch.draft[s, :, :, : len(p)].clone(),
                         batch.loops[s].cache.num_cached, batch.loops[s].cache.num_drafted)
                        for s, p in zip(slots, PROMPTS)])  # fmt: skip
        return out

    groups = []  # the groups rank 0 prefilled in one forward
    lead_group = ranks.workers[0].prefill_group

    def spy(group_slots, prompts):
        groups.append(list(group_slots))
        return lead_group(group_slots, prompts)

    ranks.workers[0].prefill_group = spy

    def prefilled(together: bool, chunk: int = 0):
        groups.clear()
        for worker in ranks.workers:
            worker.prefill_chunk = chunk
            worker.batch.latent.fill_(float("nan"))  # nothing of an earlier prefill may stand in for this one's
            worker.batch.draft.fill_(float("nan"))
        if together:
            logits = ranks.call("batch_prefill_many", slots, PROMPTS)
        else:
            logits = torch.cat([ranks.call("batch_prefill", s, p) for s, p in zip(slots, PROMPTS)])
        # the slots' loads (the drafter's context of a prompt prefilled alone goes into its draft cache here)
        ranks.call("batch_load_many", [(s, 0, len(p), None, None) for s, p in zip(slots, PROMPTS)])
        return logits, caches()

    alone = prefilled(False)
    assert groups == []
    for chunk, expected in ((200, [slots]), (24, [slots[:2]])):
        together = prefilled(True, chunk)
        assert groups == expected
        torch.testing.assert_close(together[0], alone[0], rtol=1e-5, atol=1e-5)
        for rank_together, rank_alone in zip(together[1], alone[1]):
            for (latent, draft, *counts), (latent1, draft1, *counts1) in zip(rank_together, rank_alone):
                torch.testing.assert_close(latent, latent1, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(draft, draft1, rtol=1e-5, atol=1e-5)
                assert counts == counts1
    ranks.close()


def test_group_prefills_run_as_counts_of_powers_of_two_with_graphs():
    """With graphs a prefill group runs as captured counts (powers of two, largest first, in order); eagerly whole."""
    from runner.worker import _group_parts

    assert _group_parts(list(range(13)), True) == [list(range(8)), list(range(8, 12)), [12]]
    assert _group_parts([5, 3, 9, 1], True) == [[5, 3, 9, 1]]
    assert _group_parts([4, 7, 2], True) == [[4, 7], [2]]
    assert _group_parts([4, 7, 2], False) == [[4, 7, 2]]
    assert _group_parts([], True) == [] == _group_parts([], False)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_requests_joining_and_leaving_a_batch_decode_as_alone(demo_ckpt, tp_size):
    """Five requests through three slots (prompts of different lengths, different token counts; the fourth and fifth
    join as others leave, and requests move down into freed slots): greedy ones equal autoregressive decoding; a
    sampled one draws what it draws alone (the same seed: counter-based draws per request)."""
    from runner.device.loop import generate_on_device
    from runner.sampling import Sampler, SamplingParams
    from runner.speculate import generate_autoregressive

    spec = SpecConfig(8, 16)
    ranks = cpu_ranks(demo_ckpt(tp_size), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=3)
    sampled = SamplingParams(1.0, top_k=20, seed=11)
    requests = [(PROMPTS[0], 40, None, None), (PROMPTS[1], 12, None, None), (PROMPTS[2], 30, sampled, None),
                (PROMPTS[3], 8, None, None), (PROMPTS[1], 1, None, None)]  # fmt: skip
    results, sizes, moves = run_batch(ranks, requests, 3)
    greedy = Sampler(SamplingParams())
    for (prompt, tokens, params, _), result in zip(requests, results):
        if params is None:
            assert result.tokens == generate_autoregressive(ranks, prompt, tokens, greedy).tokens
        else:
            assert result.tokens == generate_on_device(ranks, spec, prompt, tokens, 512, params=params).tokens
        assert len(result.tokens) == tokens and all(1 <= a <= 8 for a in result.accept_lengths)
    assert max(len(r.accept_lengths) for r in results) < 40  # speculation: fewer steps than tokens
    assert max(sizes) == 3 and min(sizes) < 3  # full steps, and steps after some had left
    # the fourth request takes the slot the 12-token one leaves (slot 1; no move: the freed slot is refilled), and
    # when it leaves, with nothing waiting, the sampled request moves from slot 2 into slot 1
    assert moves > 0
    ranks.close()


def test_an_autoregressive_batch_decodes_as_alone(demo_ckpt):
    from runner.sampling import Sampler, SamplingParams
    from runner.speculate import generate_autoregressive

    spec = SpecConfig(8, 16)
    ranks = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True, autoregressive=True,
                      max_batch_size=2)  # fmt: skip
    requests = [(PROMPTS[0], 20, None, None), (PROMPTS[2], 9, None, None), (PROMPTS[3], 14, None, None)]
    results, sizes, moves = run_batch(ranks, requests, 2)
    for (prompt, tokens, _, _), result in zip(requests, results):
        assert result.tokens == generate_autoregressive(ranks, prompt, tokens, Sampler(SamplingParams())).tokens
        assert result.accept_lengths == [1] * (tokens - 1)
    assert max(sizes) == 2 and moves > 0
    ranks.close()


def test_batched_slots_with_several_budgets(demo_ckpt):
    """An engine with budgets 4, 8 and 16: requests in one batch at budget 4, at 16 and at auto (the device choice
    in each slot, the policy shared) all decode as autoregressive decoding does."""
    from runner.budget import BudgetPolicy
    from runner.device.batch import Batcher
    from runner.sampling import Sampler, SamplingParams
    from runner.speculate import generate_autoregressive

    spec = SpecConfig(8, 16, extra_budgets=(4, 8))
    ranks = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=3)
    policy = BudgetPolicy((4, 8, 16), {4: 1.0, 8: 1.02, 16: 1.04})
    batcher = Batcher(ranks, 3, policy=policy)
    members = [batcher.admit(PROMPTS[i], 30, budget=b, tag=i) for i, b in enumerate((4, 16, "auto"))]
    while batcher.members:
        batcher.step()
    for i, member in enumerate(members):
        assert member.result.tokens == generate_autoregressive(ranks, PROMPTS[i], 30, Sampler(SamplingParams())).tokens
    assert set(members[0].result.budgets) == {4} and set(members[1].result.budgets) == {16}
    assert set(members[2].result.budgets) <= {4, 8, 16} and sum(policy.chosen.values()) == len(
        members[2].result.budgets
    )
    ranks.close()


def test_serve_batches_requests_in_flight(demo_ckpt, demo_engine):
    """`--serve` with max_batch_size 3: requests are served in one batch, their events interleaved, each output
    the one a one-at-a-time server gives (greedy and seeded sampled); a bad_words request runs alone on the host
    loop, a malformed one gets its error, a cancelled one never starts; one that does not stream gets its done event
    alone."""
    import io
    import json

    from engines.engine_dir import load_engine_dir
    from runner.factory import CheckpointWeights, RankOptions, local_ranks
    from runner.generator import Generator
    from runner.serving.serve import serve
    from runner.tokenizer import load_tokenizer

    engine = load_engine_dir(demo_engine(2))
    tokenizer = load_tokenizer(engine.tokenizer_dir, 512)
    build = BuildConfig(**ENGINE_LIMITS)
    requests = [{"id": "a", "text_input": "Hello world", "max_tokens": 30},
                {"id": "b", "text_input": "The quick brown fox", "max_tokens": 12},
                {"id": "c", "text_input": "Numbers: 1 2 3", "max_tokens": 20, "temperature": 0.8, "seed": 5},
                {"id": "d", "text_input": "Kimi is", "max_tokens": 8, "bad_words": ["a"]},
                {"id": "e", "text_input": "Hi", "max_tokens": 0},
                {"id": "f", "text_input": "Hi", "max_tokens": 5}, {"cancel": "f"},
                {"id": "g", "text_input": "One more", "max_tokens": 16},
                {"id": "h", "text_input": "Hello world", "max_tokens": 30, "stream": False},
                {"id": "i", "text_input": "Hi", "max_tokens": 4, "stream": "no"}]  # fmt: skip
    lines = "\n".join(map(json.dumps, requests))

    class Output(io.StringIO):  # counts the flushes: a batched step's events go out in one
        flushes = 0

        def flush(self):
            self.flushes += 1
            super().flush()

    flushes = {}

    def served(batch: int) -> list[dict]:
        options = RankOptions(device="cpu", device_loop=True, max_batch_size=batch)
        generator = Generator(local_ranks(CheckpointWeights(demo_ckpt(1)), options, engine.spec, build))
        out = Output()
        serve(generator, tokenizer, engine, engine.spec, "torch", inp=io.StringIO(lines), out=out)
        generator.ranks.close()
        flushes[batch] = out.flushes
        return [json.loads(line) for line in out.getvalue().splitlines()][1:]

    batched, alone = served(3), served(1)
    assert flushes[1] == len(alone) + 1  # one at a time: every event (and "ready") at once
    assert flushes[3] < len(batched) * 2 // 3, (flushes, len(batched))  # batched: a step's events together
    finals = {e["id"]: e for e in batched if e["event"] != "tokens"}
    expected = {e["id"]: e for e in alone if e["event"] != "tokens"}
    for name in "abcdgh":
        assert finals[name]["event"] == "done" and finals[name]["output_ids"] == expected[name]["output_ids"], name
    assert finals["h"]["output_ids"] == finals["a"]["output_ids"] and finals["h"]["text"] == finals["a"]["text"]
    assert not [e for e in batched + alone if e["id"] == "h" and e["event"] == "tokens"]  # not streamed
    assert finals["i"]["event"] == "error" and "stream must be true or false" in finals["i"]["error"]
    assert "batched: up to 3 requests a step" in finals["a"]["mode"] and "host loop" in finals["d"]["mode"]
    assert finals["e"]["event"] == "error" and finals["f"]["event"] == "cancelled"
    order = [e["id"] for e in batched if e["event"] == "tokens"]
    assert order.index("b") < max(i for i, name in enumerate(order) if name == "a")  # a and b stepped together
    streamed = {}
    for e in batched:
        if e["event"] == "tokens":
            streamed.setdefault(e["id"], []).extend(e["output_ids"])
    assert all(streamed[name] == finals[name]["output_ids"] for name in "abcg")


def test_a_new_requests_first_token_goes_out_before_the_next_step(demo_ckpt, demo_engine):
    """The batched server writes the token a request's prefill chose as soon as the prefill ends, before the batch's
    next step, instead of holding it with that step's events: a streamed request's first token arrives a step
    sooner (on two CPU cores through tritonserver 44.9 ms after the request, where one step took about 20 ms). The
    same for a request that joins a batch already stepping."""
    import io
    import json
    import time

    from engines.engine_dir import load_engine_dir
    from runner.factory import CheckpointWeights, RankOptions, local_ranks
    from runner.generator import Generator
    from runner.serving.serve import serve
    from runner.tokenizer import load_tokenizer

    engine = load_engine_dir(demo_engine(2))
    tokenizer = load_tokenizer(engine.tokenizer_dir, 512)
    options = RankOptions(device="cpu", device_loop=True, max_batch_size=2)
    generator = Generator(
        local_ranks(CheckpointWeights(demo_ckpt(1)), options, engine.spec, BuildConfig(**ENGINE_LIMITS))
    )
    out = io.StringIO()
    batcher = generator.batcher

    def marked_batcher():  # each step writes a marker line first, past the events the server may be holding
        made = batcher()
        step = made.step

        def marked_step():
            out.write(json.dumps({"event": "step", "members": sorted(m.tag for m in made.members.values())}) + "\n")
            return step()

        made.step = marked_step
        return made

    generator.batcher = marked_batcher

    class Inbox(io.StringIO):  # "b" arrives once "a" has stepped twice: it joins a batch already stepping
        def __iter__(self):
            yield json.dumps({"id": "a", "text_input": "Hello world", "max_tokens": 24}) + "\n"
            deadline = time.monotonic() + 120
            while out.getvalue().count('"event": "step"') < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            yield json.dumps({"id": "b", "text_input": "The quick brown fox", "max_tokens": 12}) + "\n"

    serve(generator, tokenizer, engine, engine.spec, "torch", inp=Inbox(), out=out)
    generator.ranks.close()
    events = [json.loads(line) for line in out.getvalue().splitlines()][1:]
    for name in "ab":
        first = next(i for i, e in enumerate(events) if e.get("id") == name and e["event"] == "tokens")
        stepped = next(i for i, e in enumerate(events) if e["event"] == "step" and name in e["members"])
        assert first < stepped, (name, [(e["event"], e.get("id"), e.get("members")) for e in events])
    assert sorted(e["id"] for e in events if e["event"] == "done") == ["a", "b"]
    assert any(e["event"] == "step" and e["members"] == ["a", "b"] for e in events)  # b joined a's batch


def test_a_request_cancelled_mid_batch_leaves_and_the_others_finish(demo_ckpt, demo_engine):
    """`{"cancel": id}` while its request is in the batch (after its first tokens): it ends with "cancelled" and
    the tokens it streamed; the request beside it finishes, and a request sent after the cancellation is served
    (both slots were busy until then)."""
    import json
    import os
    import threading
    import time

    from engines.engine_dir import load_engine_dir
    from runner.factory import CheckpointWeights, RankOptions, local_ranks
    from runner.generator import Generator
    from runner.serving.serve import serve
    from runner.tokenizer import load_tokenizer

    engine = load_engine_dir(demo_engine(2))
    tokenizer = load_tokenizer(engine.tokenizer_dir, 512)
    options = RankOptions(device="cpu", device_loop=True, max_batch_size=2)
    build = BuildConfig(**ENGINE_LIMITS)
    generator = Generator(local_ranks(CheckpointWeights(demo_ckpt(1)), options, engine.spec, build))

    class Events:  # serve's output, readable while it runs
        def __init__(self):
            self.lines, self.lock = [], threading.Lock()

        def write(self, text):
            with self.lock:
                self.lines += [json.loads(line) for line in text.splitlines() if line]

        def flush(self):
            pass

        def seen(self, request_id, kind):
            with self.lock:
                return any(e.get("id") == request_id and e["event"] == kind for e in self.lines)

    read, write = os.pipe()
    inp, feed, out = os.fdopen(read), os.fdopen(write, "w"), Events()
    server = threading.Thread(target=serve, args=(generator, tokenizer, engine, engine.spec, "torch"),
                              kwargs={"inp": inp, "out": out})  # fmt: skip
    server.start()
    send = lambda r: (feed.write(json.dumps(r) + "\n"), feed.flush())  # noqa: E731
    send({"id": "long", "text_input": "Hello world", "max_tokens": 300, "end_id": -1})
    send({"id": "short", "text_input": "The quick brown fox", "max_tokens": 40, "end_id": -1})
    deadline = time.monotonic() + 60
    while not out.seen("long", "tokens") and time.monotonic() < deadline:
        time.sleep(0.01)
    send({"cancel": "long"})
    send({"id": "after", "text_input": "Numbers", "max_tokens": 10})
    while not (out.seen("after", "done") and out.seen("short", "done")) and time.monotonic() < deadline:
        time.sleep(0.01)
    feed.close()
    server.join(60)
    generator.ranks.close()
    finals = {e["id"]: e for e in out.lines if e.get("event") in ("done", "cancelled", "error")}
    streamed = [t for e in out.lines if e.get("id") == "long" and e["event"] == "tokens" for t in e["output_ids"]]
    assert finals["long"]["event"] == "cancelled" and finals["long"]["output_ids"] == streamed
    assert 0 < len(streamed) < 300
    assert finals["short"]["event"] == "done" and len(finals["short"]["output_ids"]) == 40
    assert finals["after"]["event"] == "done" and len(finals["after"]["output_ids"]) == 10


def test_the_step_budget_policy_explores_times_then_takes_the_best_rate():
    """`StepBudgetPolicy` (a batch's, or a lone request's with one slot): the largest budget until its steps
    informed every budget's acceptance, each budget twice to time it (one time can be an outlier; at the first slot
    count it runs at),
    then the most tokens a second; the largest again when the exploration credit (a share of the chosen steps' time:
    2 % while the largest budget could still win, 0.2 % once even its optimistic rate loses) covers what it costs
    over the chosen budget, never twice within 8 steps; as a batch's wide steps get dearer the choice moves to a
    narrower budget."""
    from runner.device.budget import MIN_TIMED, StepBudgetPolicy

    assert MIN_TIMED == 2
    policy = StepBudgetPolicy((8, 32, 16))
    # two busy slots: budget 16 accepts what 32 does; the drafter expected a little more
    stats = [{"accepted": {8: 2, 16: 3, 32: 3}, "drafted": {8: 2.5, 16: 3.5, 32: 4.0}}] * 2
    assert policy.choose(2, 2) == 32
    policy.record(2, 32, 1.0, stats)
    assert policy.informed == {8: 2, 16: 2, 32: 2} and policy.expected(8) == 3.0 and policy.expected(32) == 4.0
    assert policy.predicted == {8: 5.0, 16: 7.0, 32: 8.0}
    assert policy.choose(2, 2) == 32  # still fewer than 4 slot-steps informed
    policy.record(2, 32, 1.0, stats)
    for budget, seconds in ((8, 0.5), (16, 0.95)):  # each (slots, budget) pair timed twice (32 already is)
        for _ in range(2):
            assert policy.choose(2, 2) == budget
            policy.record(2, budget, seconds, [])
    policy.record(2, 16, None, [])  # a step that captured its graph: no time
    assert policy.cost(8, 2) == 0.5 and policy.cost(16, 2) == 0.95 and policy.steps == 6
    # 2 x 3 tokens / 0.5 s = 12 beats 2 x 4 / 0.95 = 8.4 and 2 x 4 / 1.0 = 8, and the largest's optimistic rate
    # (4 slot-steps: 2 x (4 + 2 x 0.25) / 1.0 = 9) cannot reach 12: its credit grows by 0.2 % of 0.5 s
    assert policy.choose(2, 2) == 8
    for _ in range(3):
        policy.record(2, 8, 0.95, [])  # budget 8 now 0.95 s (the median of 5): 6.3 a second; budget 16 gives 8.4
    # now the largest could win (9 >= 8.4): 2 % of 0.95 s a step pays its 0.05 s extra in 3 steps, which also keep
    # the 8 steps' gap since the last exploration (step 2): steps 8 and 9 take 16, step 10 the largest
    assert [policy.choose(2, 2) for _ in range(3)] == [16, 16, 32]
    assert policy.chosen[(2, 32)] == 3 and policy.steps == 10
    assert [policy.choose(2, 2) for _ in range(8)] == [16] * 7 + [32]  # every 8th while it could win
    # settled: 64 slot-steps with the same means and no spread; the largest's optimistic rate 2 x 4.125 / 1.0 = 8.25
    # is below 8.4, its credit grows by 0.2 % of 0.95 s a step: 27 steps pay its 0.05 s extra
    policy.informed, policy.accepted = dict.fromkeys((8, 16, 32), 64), {8: 128.0, 16: 192.0, 32: 192.0}
    policy.squares = {8: 256.0, 16: 576.0, 32: 576.0}
    later = [policy.choose(2, 2) for _ in range(112)]
    assert [i for i, b in enumerate(later) if b == 32] == [26, 53, 80, 107]


def test_a_settled_batch_step_reports_statistics_only_where_they_tell_what_its_tokens_do_not():
    """Statistics (every slot's nodes ranked, the drafter's expectation, what each budget would have accepted) cost
    a batched step time, so a settled step asks for them only where its emitted tokens do not tell the same: never at
    the smallest budget (its accepted length is its acceptance, `observe`), every `REPORT_GAP`-th step at a larger
    budget (it tells the budgets below it); steps that learn or explore always report, steps taken to time their
    budget never (their time is a settled step's). A reported step costs more (the ranking, the copy): its time
    counts (`Batcher.step`) only while its (slots, budget) pair has no other."""
    from runner.device.budget import DECODE, MIN_INFORMED, REPORT_GAP, StepBudgetPolicy

    costs = {DECODE: 0.5, 8: 1.0, 16: 1.1, 32: 1.6}
    accepted = {8: 3, 16: 3, 32: 4}  # budget 8 wins: 4 tokens a ms against 4 / 1.1 and 5 / 1.6
    ranking = 0.3  # what reporting adds to a step

    def run(policy, steps):
        taken = []
        for _ in range(steps):
            budget = policy.choose(2, 2)
            report = policy.reports(budget)
            taken.append((budget, report, policy.settled, policy.timing))
            stats = [{"accepted": accepted, "drafted": dict.fromkeys(accepted, 3.5)}] * 2
            seconds = costs[budget] + (ranking if report else 0.0)
            policy.record(2, budget, None if report and policy.timed(budget, 2) else seconds, stats if report else [])
            if not report and budget != DECODE:
                policy.observe(budget, [accepted[budget]] * 2)
        return taken

    policy = StepBudgetPolicy((8, 16, 32), decode=True, narrow_informs=True)
    taken = run(policy, 600)
    learning = [t for t in taken if not t[2] and not t[3]]
    timing = [t for t in taken if t[3]]
    assert learning and all(report == (budget != DECODE) for budget, report, *_ in learning)
    assert {b for b, *_ in timing} == {DECODE, 8, 16} and not any(report for _, report, *_ in timing)
    assert taken[0] == (32, True, False, False) and MIN_INFORMED <= 4
    settled = [(budget, report) for budget, report, s, _ in taken if s]
    assert {b for b, _ in settled} == {8} and not any(report for _, report in settled)
    assert policy.informed[8] - policy.reported[8] == 2 * (len(settled) + 2) and policy.expected(8) == 4.0
    assert policy.reported[32] == policy.informed[32]  # every step at 32 explored, and reported
    # the costs: 16's and 8's from unreported steps alone; budget 32's from its first two (reported) steps only, not
    # from the exploring step after them (at the settled share: 0.2 % of budget 8's 1.0 a step pays its 0.9 extra)
    assert set(policy.times[(2, 16)]) == {1.1} and set(policy.times[(2, 8)]) == {1.0}
    assert list(policy.times[(2, 32)]) == [1.6 + ranking] * 2 and policy.chosen[(2, 32)] == 3
    # budget 16 the best (8 dearer now): a settled step at 16 reports every REPORT_GAP-th step
    costs[8] = 1.5
    policy.times.clear()
    taken = run(policy, 200)[20:]
    at16 = [report for budget, report, s, _ in taken if s and budget == 16]
    assert len(at16) > 100 and abs(sum(at16) - len(at16) / REPORT_GAP) <= 2


def test_a_batch_policy_seeded_with_warm_up_costs_takes_no_step_to_time_a_choice():
    """Costs timed at warm-up at some slot counts (`step_costs`): after the first step (the largest budget, which
    informs every budget's acceptance) each step takes the best rate, at the counts timed and between them (the line
    between the nearest), never a choice only to time it; the steps' own times join the warm-up's."""
    from runner.device.budget import DECODE, StepBudgetPolicy

    seeds = {1: {DECODE: 0.6, 8: 0.9, 16: 1.0, 32: 1.2}, 16: {DECODE: 1.0, 8: 1.7, 16: 2.1, 32: 2.4}}
    step_costs = {(count, b): s for count, row in seeds.items() for b, s in row.items()}
    policy = StepBudgetPolicy((8, 16, 32), decode=True, narrow_informs=True, step_costs=step_costs)
    stats = [{"accepted": {8: 2, 16: 2, 32: 2}, "drafted": {8: 2.5, 16: 3.0, 32: 3.5}}] * 16
    assert policy.choose(16, 16) == 32 and not policy.settled
    policy.record(16, 32, 2.4, stats)
    chosen = []
    for count in (16, 12, 4):  # 3 tokens a request: budget 8 the best rate at each count
        for _ in range(5):
            budget = policy.choose(count, count)
            chosen.append((budget, policy.settled))
            policy.record(count, budget, {16: 1.7, 12: 1.5, 4: 1.1}[count], [])
    assert chosen == [(8, True)] * 15
    assert policy.cost(8, 16) == 1.7 and len(policy.times[(16, 8)]) == 6 and policy.cost(8, 4) == 1.1
    assert policy.cost(DECODE, 12) == 0.6 + (1.0 - 0.6) * 11 / 15  # the line between the counts warm-up timed


def test_a_batch_policy_takes_autoregressive_steps_when_no_tree_pays():
    """With `decode`, an autoregressive step (`DECODE`: one token a request) is a choice like a budget: timed twice
    where first taken, estimated at other batch sizes until taken there, and taken when its tokens a second win (one
    H200, the trained pair, 16 requests: budget 8's steps cost about 4.5 times an autoregressive one's for about 3
    tokens a request); trees still win while the batch is small; the largest budget is still explored now and then
    (its steps inform every budget)."""
    from runner.device.budget import DECODE, StepBudgetPolicy

    policy = StepBudgetPolicy((8, 32), decode=True)
    assert policy.options == (DECODE, 8, 32) and policy.expected(DECODE) == 1.0
    costs = {1: {DECODE: 0.6, 8: 0.75, 32: 0.9}, 16: {DECODE: 1.3, 8: 6.0, 32: 9.0}}
    stats = {"accepted": {8: 2, 32: 3}, "drafted": {8: 2.5, 32: 3.5}}
    chosen = {1: [], 16: []}
    for count in (1, 16, 1, 16):
        for _ in range(60):
            budget = policy.choose(count, count)
            policy.record(count, budget, costs[count][budget], [stats] * count if budget == 32 else [])
            chosen[count].append(budget)
    assert policy.summary()[16]["ms"] == {DECODE: 1300.0, 8: 6000.0, 32: 9000.0}
    # one request: 4 tokens / 0.9 s (budget 32) beats 3 / 0.75 and 1 / 0.6
    assert chosen[1][-20:] == [32] * 20
    # sixteen: 16 / 1.3 s beats 16 x 4 / 9 and 16 x 3 / 6; budget 32 explored (every credit) at most a few times
    late = chosen[16][-60:]
    assert late.count(DECODE) >= 55 and set(late) <= {DECODE, 32} and 8 not in late


def test_a_budget_that_could_not_win_at_a_whole_block_is_neither_learnt_nor_explored():
    """With `max_tokens` (a block: the most tokens a request emits in a step), a batch's budget whose step could not
    beat the best sure rate (one token a request) even if every request emitted a block is ruled out at that batch
    size: the first steps learn from the largest budget that could win, and exploring never reaches the others
    (the trained pair on two CPU cores, 16 slots: budget 32's step 145 ms, an autoregressive one 13.4); at a batch
    size where it could win, the largest budget is learnt first as before."""
    from runner.device.budget import DECODE, MIN_INFORMED, StepBudgetPolicy

    seeds = {1: {DECODE: 5.0, 8: 12.0, 16: 13.0, 32: 16.0}, 16: {DECODE: 13.4, 8: 68.0, 16: 92.0, 32: 145.0}}
    step_costs = {(c, b): ms / 1e3 for c, costs in seeds.items() for b, ms in costs.items()}
    stats = {"accepted": {8: 7, 16: 7, 32: 7}, "drafted": {8: 6.0, 16: 6.5, 32: 7.0}}  # a drafter right every time
    policy = StepBudgetPolicy((8, 16, 32), decode=True, narrow_informs=True, step_costs=step_costs, max_tokens=8)
    assert policy.possible(seeds[16]) == (8, 16) and policy.possible(seeds[1]) == (8, 16, 32)
    chosen = []
    for _ in range(400):
        budget = policy.choose(16, 16)
        told = [b for b in (8, 16, 32) if b <= budget]
        policy.record(16, budget, seeds[16][budget] / 1e3, [{k: {b: v[b] for b in told} for k, v in stats.items()}] * 16
                      if budget != DECODE else [])  # fmt: skip
        chosen.append(budget)
    assert chosen[0] == 16 and 32 not in chosen and policy.informed[32] == 0
    assert chosen[-50:].count(8) >= 45  # 8 tokens / 68 ms beats 8 / 92 and 1 / 13.4
    # without the ceiling the same first steps go to the largest budget
    unbounded = StepBudgetPolicy((8, 16, 32), decode=True, narrow_informs=True, step_costs=step_costs)
    assert unbounded.choose(16, 16) == 32
    # one slot: budget 32 could win, and is learnt first
    assert policy.choose(1, 1) == 32 and policy.informed[32] < MIN_INFORMED


def test_a_new_batch_size_takes_its_costs_from_the_sizes_timed_and_spends_no_step_timing():
    """A slot count not timed yet at a budget takes the line between the nearest counts timed at that budget (one
    side: its nearest) until its own steps time it, so the batch's steps at each new size (requests leaving one by
    one) go to the best estimated choice, not to timing every choice twice (one H200, 16 requests leaving: a third
    of `auto`'s steps were such timing steps)."""
    from runner.device.budget import DECODE, StepBudgetPolicy

    costs = {1: {DECODE: 0.6, 8: 0.9, 32: 1.2}, 16: {DECODE: 1.0, 8: 1.7, 32: 4.0}}
    policy = StepBudgetPolicy((8, 32), {b: s for b, s in costs[1].items() if b != DECODE}, decode=True)
    stats = {"accepted": {8: 2, 32: 3}, "drafted": {8: 2.5, 32: 3.5}}
    for _ in range(40):  # sixteen slots: the informing steps, every choice timed, then the best
        budget = policy.choose(16, 16)
        policy.record(16, budget, costs[16][budget], [stats] * 16 if budget == 32 else [])
    assert policy.timed(8, 16) and policy.timed(DECODE, 16) and not policy.timed(8, 4)
    assert policy.cost(8, 4) == 0.9 + (1.7 - 0.9) * 3 / 15  # the line between 1 and 16 slots
    assert policy.cost(DECODE, 4) == 1.0  # timed at 16 only
    steps = policy.steps
    # four slots: budget 8 (3 tokens / 1.06 s a request) beats 32 (4 / 1.76) and an autoregressive step (1 / 1.0)
    assert [policy.choose(4, 4) for _ in range(5)] == [8] * 5
    assert policy.chosen[(4, DECODE)] == 0 and policy.steps == steps + 5
    policy.record(4, 8, 1.3, [])
    policy.record(4, 8, 1.3, [])
    assert policy.cost(8, 4) == 1.3  # its own times, once it has two


def test_exploring_costs_a_small_share_of_the_time_whatever_the_budgets_cost():
    """With a Kimi K2 rank's step costs (budget 32 three times budget 8) and a drafter that is never right, the steps
    at the largest budget after the first ones cost at most about 0.2 % of the time over what budget 8 would have
    taken; with the trained pair's costs on one H200 (nearly equal) exploring is cheap, and stays at least 8 apart."""
    from runner.device.budget import MIN_INFORMED, StepBudgetPolicy

    for costs, wanted in (({8: 15.5, 16: 24.0, 32: 46.5}, 0.0025), ({8: 1.01, 16: 1.03, 32: 1.33}, 0.025)):
        policy = StepBudgetPolicy(tuple(costs), costs)
        wrong = {"accepted": dict.fromkeys(costs, 0), "drafted": dict.fromkeys(costs, 0.5)}
        chosen = []
        for _ in range(2000):
            budget = policy.choose()
            policy.record(1, budget, costs[budget], [wrong] if budget == 32 else [])
            chosen.append(budget)
        assert chosen[:MIN_INFORMED] == [32] * MIN_INFORMED and set(chosen[MIN_INFORMED:]) == {8, 32}
        rest = chosen[MIN_INFORMED:]
        overhead = rest.count(32) * (costs[32] - costs[8]) / sum(costs[b] for b in rest)
        assert 0 < overhead <= wanted, (costs, overhead)
        explored = [i for i, b in enumerate(chosen) if b == 32]
        assert min(b - a for a, b in zip(explored[MIN_INFORMED - 1 :], explored[MIN_INFORMED:])) >= 8


def test_an_exploring_step_takes_the_most_hopeful_budget_above_the_choice():
    """A batch whose autoregressive steps win on the estimates, where budget 8 could still win (few request-steps,
    wide error bars) and 16 and 32 could not: the exploring step goes to budget 8 (its extra cost paid by 2 % of the
    chosen steps' time), not to the largest (which the settled share would reach only after about 2500 steps here);
    its statistics tell budget 8 alone, and budget 8 then wins."""
    from runner.device.budget import DECODE, StepBudgetPolicy

    policy = StepBudgetPolicy((8, 16, 32), decode=True, narrow_informs=True)
    costs = {DECODE: 1.0, 8: 1.5, 16: 2.0, 32: 6.0}  # seconds a step of four slots
    for budget, seconds in costs.items():
        policy.record(4, budget, seconds, [])
        policy.record(4, budget, seconds, [])
    # four request-steps at 32: budget 8 accepted 1 drafted token in one of them, 32 one in each
    policy.informed = dict.fromkeys((8, 16, 32), 4)
    policy.accepted, policy.squares = {8: 1.0, 16: 1.0, 32: 4.0}, {8: 1.0, 16: 1.0, 32: 4.0}
    chosen = [policy.choose(4, 4) for _ in range(40)]
    first = chosen.index(8)
    assert set(chosen[:first]) == {DECODE} and 20 <= first <= 30 and 16 not in chosen and 32 not in chosen
    policy.chosen.clear()
    policy.record(4, 8, 1.5, [{"accepted": {8: 3, 16: 3, 32: 3}, "drafted": {8: 2.0, 16: 2.5, 32: 3.0}}] * 4)
    assert policy.informed == {8: 8, 16: 4, 32: 4} and policy.accepted[16] == 1.0
    assert policy.choose(4, 4) == 8  # 4 x (1 + 13 / 8) / 1.5 = 7 tokens a second against 4
    lone = StepBudgetPolicy((8, 16, 32), decode=True)  # a lone request's narrower steps tell nothing: the largest
    for budget, seconds in costs.items():
        lone.record(4, budget, seconds, [])
        lone.record(4, budget, seconds, [])
    lone.informed = dict.fromkeys((8, 16, 32), 4)
    lone.accepted, lone.squares = {8: 1.0, 16: 1.0, 32: 4.0}, {8: 1.0, 16: 1.0, 32: 4.0}
    assert {lone.choose(4, 4) for _ in range(40)} == {DECODE}


def test_a_batch_wide_step_at_a_smaller_budget_reports_what_the_largest_tells_of_it(demo_ckpt):
    """From the same batch state, a batch-wide step at budget 8 (or 4) reports, for every budget up to its own, the
    drafter's expectation and the accepted tokens that a step at the largest budget reports (its tree is the largest
    tree's best nodes): the statistics `StepBudgetPolicy` learns each budget from; an autoregressive step reports
    none."""
    from runner.device.budget import DECODE
    from runner.generator import Generator

    spec = SpecConfig(8, 32, extra_budgets=(4, 8))
    ranks = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=3)
    ranks.lead.batch.run_ahead = False  # the batcher's last step read when it returns (the steps below are the test's)
    generator = Generator(ranks)
    generator.policy = object()  # `auto`'s single-request costs are not needed: the batch chooses
    batcher = generator.batcher()
    for i in range(3):
        generator.admit(batcher, PROMPTS[i], 40, budget="auto", tag=i)
    for _ in range(3):
        batcher.step()
    batch = ranks.lead.batch
    state = [batch.num_cached, batch.num_drafted, batch.context_count, batch.bonus, batch.context]
    saved = [t.clone() for t in state]
    told = {}
    for budget in (32, 8, 4, DECODE):
        for tensor, value in zip(state, saved):
            tensor.copy_(value)
        batch.step(3, budget)
        told[budget] = [loop.last_stats for loop in batch.loops[:3]]
    ranks.close()
    assert told[DECODE] == [None] * 3
    for slot in range(3):
        full = told[32][slot]
        assert full["budget"] == 32 and full["drafted"][4] < full["drafted"][8] < full["drafted"][32]
        for budget in (8, 4):
            stats = told[budget][slot]
            assert stats["budget"] == budget
            for b in (4, 8)[: 1 + (budget == 8)]:
                assert stats["accepted"][b] == full["accepted"][b], (slot, budget, b)
                assert stats["drafted"][b] == pytest.approx(full["drafted"][b], rel=1e-6), (slot, budget, b)


def test_a_batch_of_auto_requests_shares_one_budget_a_step(demo_ckpt):
    """Every request `auto` on an engine with budgets 4, 8 and 32: each step has one budget for the batch (its tree
    on that budget's rows) or is an autoregressive step; with the oracle drafter a step at budget 4 accepts 4 drafted
    tokens and the bonus, at 8 or 32 the whole block, an autoregressive step one token; the tokens are the
    autoregressive ones."""
    from runner.generator import Generator
    from runner.probes import Probes
    from runner.sampling import Sampler, SamplingParams
    from runner.speculate import generate_autoregressive

    spec = SpecConfig(8, 32, extra_budgets=(4, 8))
    reference = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS))
    expected = generate_autoregressive(reference, PROMPTS[0], 96, Sampler(SamplingParams())).tokens
    reference.close()
    probes = Probes(oracle=torch.tensor(expected))
    ranks = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=3,
                      probes=probes)  # fmt: skip
    generator = Generator(ranks)
    generator.policy = object()  # `auto`'s single-request costs are not needed: the batch chooses
    batcher = generator.batcher()
    members = [generator.admit(batcher, PROMPTS[0], 96, budget="auto", tag=i) for i in range(3)]
    while batcher.members:
        batcher.step()
    ranks.close()
    for member in members:
        result = member.result
        assert result.tokens == expected
        assert set(result.budgets) == {0, 4, 8, 32}  # explored, timed (autoregressive steps too), then chosen
        for budget, accepted in zip(result.budgets[:-1], result.accept_lengths[:-1]):
            assert accepted == {0: 1, 4: 5}.get(budget, 8), (budget, accepted)
    # the steps at 32 told every budget, those at 4 and 8 told their own and the smaller ones
    informed = batcher.batch_policy.informed
    assert informed[32] >= 6 and informed[4] > informed[32]


def test_the_lazy_context_switch_takes_0_or_1_and_names_anything_else(demo_ckpt, monkeypatch):
    """`DDTREE_LAZY_CONTEXT` (an autoregressive step's drafter row left pending, on by default): 0 turns it off, and a
    value that is neither is an error that names the variable, what it takes and the value; so is a
    `DDTREE_CONTEXT_BLOCKS` (the blocks of rows left pending) that is not a whole number of at least 1."""
    spec, limits = SpecConfig(8, 16, extra_budgets=(4, 8)), BuildConfig(**ENGINE_LIMITS)
    monkeypatch.setenv("DDTREE_LAZY_CONTEXT", "0")
    monkeypatch.setenv("DDTREE_CONTEXT_BLOCKS", "3")  # a pending context of blocks, with the lazy context only
    ranks = cpu_ranks(demo_ckpt(1), spec, limits, device_loop=True, max_batch_size=2)
    assert not ranks.lead.batch.lazy_context and ranks.lead.batch.context_rows == spec.block_size
    ranks.close()
    monkeypatch.setenv("DDTREE_LAZY_CONTEXT", "yes")
    with pytest.raises(ValueError, match=r"DDTREE_LAZY_CONTEXT: expected 0 or 1 .* got 'yes'"):
        cpu_ranks(demo_ckpt(1), spec, limits, device_loop=True, max_batch_size=2)
    monkeypatch.setenv("DDTREE_LAZY_CONTEXT", "1")
    monkeypatch.setenv("DDTREE_CONTEXT_BLOCKS", "0")
    with pytest.raises(ValueError, match=r"DDTREE_CONTEXT_BLOCKS: expected a whole number of at least 1 .* got '0'"):
        cpu_ranks(demo_ckpt(1), spec, limits, device_loop=True, max_batch_size=2)


@pytest.mark.parametrize("lazy,ahead,blocks", [(True, False, 1), (False, False, 1), (False, True, 1), (True, True, 1),
                                               (True, False, 2), (True, True, 2)])  # fmt: skip
def test_autoregressive_steps_in_a_speculative_batch_are_lossless(demo_ckpt, monkeypatch, lazy, ahead, blocks):
    """An all-`auto` batch whose steps alternate between autoregressive steps (`DECODE`) and trees of each budget,
    requests of different prompts and lengths joining and leaving: every request's tokens are its autoregressive
    ones; after every step each slot's drafter has every committed row but its pending context's (the last tree
    step's accepted rows and, with `BatchLoop.lazy_context` (the default), the autoregressive steps' since, up to
    `blocks` blocks (`DDTREE_CONTEXT_BLOCKS`, `BatchLoop.context_rows`), then committed in one call, or before a tree
    step that finds more than a block pending (`BatchLoop._flush`); without it (`DDTREE_LAZY_CONTEXT=0`), each step
    commits them), and the draft cache holds what steps that only drafted would have written there. ahead: each
    step queued before the previous one's tokens are read (`run_ahead_auto`; the policy choosing one step behind),
    autoregressive steps behind tree steps and behind each other among them (with `lazy_context`, one behind a tree
    step commits that step's rows: its form cannot wait for their count)."""
    from runner.device.budget import DECODE, ScriptedPolicy
    from runner.generator import Generator
    from runner.sampling import Sampler, SamplingParams
    from runner.speculate import generate_autoregressive

    spec = SpecConfig(8, 16, extra_budgets=(4, 8))
    reference = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS))
    greedy = Sampler(SamplingParams())
    lengths = [40, 12, 25, 20]  # the first the longest: its slot is not taken again before the end
    expected = [generate_autoregressive(reference, PROMPTS[i], n, greedy).tokens for i, n in enumerate(lengths)]
    reference.close()
    drafts, most_pending, forms, behind, flushed = [], {}, set(), [], []
    # the second script's runs of autoregressive steps fill a slot's pending context to a block and commit it (with
    # two blocks: leave more than a block pending, which the tree step after them flushes); the third's, two blocks
    scripts = [[DECODE, DECODE, 16, DECODE, 4, 8, DECODE, 16], [DECODE] * 9 + [8]]
    scripts += [[DECODE] * 17 + [8]] * (blocks > 1) + [[4]]
    monkeypatch.setenv("DDTREE_CONTEXT_BLOCKS", str(blocks))
    for script in scripts:
        ranks = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=3)
        batch = ranks.lead.batch
        assert batch.lazy_context  # the default
        assert batch.context_rows == blocks * spec.block_size
        batch.lazy_context, decode_form, flush = lazy, batch.decode_form, batch._flush

        def spy(count, budget, decode_form=decode_form):  # the autoregressive steps' forms (width, append)
            form = decode_form(count, budget)
            if budget == DECODE:
                forms.add(form)
            return form

        batch.decode_form = spy
        batch._flush = lambda count, flush=flush: (flushed.append(count), flush(count))
        batch.run_ahead = batch.run_ahead_auto = ahead
        launch = batch.launch

        def queued(count, budget=None, report=True, launch=launch, batch=batch):  # each step queued behind another
            if batch.in_flight:
                behind.append((batch.in_flight[-1][2], budget))  # (the budget of the step ahead, its own)
            return launch(count, budget, report)

        batch.launch = queued
        generator = Generator(ranks)
        generator.policy = object()  # `auto`'s single-request costs are not needed: the batch chooses
        batcher = generator.batcher()
        batcher.batch_policy = ScriptedPolicy(script, budgets=(4, 8, 16))
        loops = ranks.lead.batch.loops
        waiting, members = list(range(len(lengths))), []
        while waiting or batcher.members:
            while waiting and batcher.free:
                i = waiting.pop(0)
                members.append(generator.admit(batcher, PROMPTS[i], lengths[i], budget="auto", tag=i))
            batcher.step()
            for slot in batcher.members if not batcher.in_flight else ():  # (the host's count: from a read step)
                loop = loops[slot]
                assert int(loop.num_drafted) + int(loop.context_count) == int(loop.num_cached)
                assert int(loop.context_count) == loop.pending <= batch.context_rows  # the host's count, the device's
                most_pending[len(script)] = max(most_pending.get(len(script), 0), loop.pending)
        for member in members:
            assert member.result.tokens == expected[member.tag], (script, member.tag)
        budgets = [b for m in members for b in m.result.budgets]
        assert set(budgets) == set(script)
        # the first request's slot (0), which it held to the end: its draft cache's committed rows
        drafts.append(loops[0].cache.draft[:, :, : int(loops[0].num_drafted)].clone())
        ranks.close()
    # lazy: autoregressive steps' rows stayed pending up to `context_rows`, appended, then committed all at once
    # (behind a tree step in flight: its block); else each autoregressive step commits (one row after a load or such
    # a step, a block after a tree)
    rows, block = blocks * spec.block_size, spec.block_size
    if lazy:
        assert {(0, True), (rows, False)} <= forms <= {(0, True), (rows, False), (block, False)}
    else:
        assert forms == {(1, False), (block, False)}
    if not lazy:
        assert most_pending[10] < block
    elif blocks == 1:
        assert most_pending[10] == block
    else:  # more than a block pending, which the tree steps after them flushed first; two blocks, then committed
        assert block < most_pending[10] <= rows and most_pending[18] == rows
    assert bool(flushed) == (lazy and blocks > 1)
    if ahead:  # autoregressive steps queued behind tree steps and behind each other, trees behind both
        assert {(16, DECODE), (DECODE, DECODE), (DECODE, 16)} <= set(behind)
    else:
        assert not behind
    rows = min(d.shape[2] for d in drafts)
    assert rows > 20
    for draft in drafts[:-1]:
        torch.testing.assert_close(draft[:, :, :rows], drafts[-1][:, :, :rows], rtol=1e-5, atol=1e-5)


def test_a_batch_at_one_fixed_budget_steps_that_budget_and_the_warm_up_takes_every_step_form(demo_ckpt, monkeypatch):
    """An engine of budgets 4, 8 and 16: requests all at budget 8 step the batch-wide form of budget 8 (its rows
    only, not the largest budget's) and decode as autoregressive decoding does; a mixed batch steps each slot's own;
    the GPU warm-up of the batch (`Generator._warm_batch`, run here on the CPU) takes every form at every slot count
    (mixed, each budget, autoregressive steps) and leaves the batch policy untaught but for the costs it timed
    (`Generator.measure_batch_costs`)."""
    from runner.device.budget import DECODE
    from runner.generator import Generator
    from runner.sampling import Sampler, SamplingParams
    from runner.speculate import generate_autoregressive

    GREEDY = SamplingParams()
    spec = SpecConfig(8, 16, extra_budgets=(4, 8))
    monkeypatch.setenv("DDTREE_CONTEXT_BLOCKS", "2")  # as on a GPU, more than a block pending (8 blocks there)
    ranks = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=3)
    generator, batch = Generator(ranks), ranks.lead.batch
    taken, launch, flush, flushed = [], batch.launch, batch._flush, set()

    def spy(count, budget=None, report=True):  # the graph's key (`BatchLoop.launch`)
        form = batch.decode_form(count, budget) if budget == DECODE else ()
        taken.append((count, budget, report or budget in (None, DECODE), *form))
        return launch(count, budget, report)

    batch.launch = spy
    batch._flush = lambda count: (flushed.add(count), flush(count))
    results = generator.generate_many(PROMPTS[:3], 20, [GREEDY] * 3, budget=8)
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == generate_autoregressive(ranks, prompt, 20, Sampler(SamplingParams())).tokens
    assert {b for _, b, _ in taken} == {8} and not any(r for *_, r in taken)  # no statistics: no policy learns
    taken.clear()
    generator.generate_many(PROMPTS[:2], 6, [GREEDY] * 2, budget=[4, 16])
    assert {b for _, b, _ in taken} == {None}
    taken.clear()
    generator._warm_batch(PROMPTS[0], GREEDY)
    generator.measure_batch_costs(PROMPTS[0], GREEDY)  # the GPU warm-up's next call, once for every form
    forms = {(c, b, True) for c in (1, 2, 3) for b in (4, 8, 16)} | {(2, None, True), (3, None, True)}
    forms |= {(c, b, False) for c in (1, 2, 3) for b in (4, 8, 16)}  # a batch all at one fixed budget
    # autoregressive steps (`lazy_context`) appending a row to the pending context, then committing two blocks of
    # them; and the flush of more than a block before a tree step
    forms |= {(c, DECODE, True, *form) for c in (1, 2, 3) for form in ((0, True), (16, False))}
    assert set(taken) == forms and flushed == {1, 2, 3}
    # the batch policy, untaught, starts from a cost timed at each slot count of 1, 2 ... and the most, each choice
    policy = generator.batch_policy
    assert policy is not None and not policy.chosen and not any(policy.informed.values())
    assert policy.seeded == {(c, b) for c in (1, 2, 3) for b in (DECODE, 4, 8, 16)}
    assert all(len(policy.times[pair]) == 1 and policy.cost(pair[1], pair[0]) > 0 for pair in policy.seeded)
    ranks.close()


@pytest.mark.parametrize("queued", [True, False])
def test_a_batchs_choices_are_timed_queued_where_an_auto_batch_queues_its_steps(demo_ckpt, monkeypatch, queued):
    """Where an `auto` batch queues its steps ahead (`DDTREE_RUN_AHEAD_AUTO=1`, `lazy_context` off), the warm-up
    times each choice as such a batch runs it: most of its steps queued behind another, so the host's work between
    steps is not counted twice (`Generator.measure_batch_costs`); where it does not, each choice one step at a
    time."""
    from runner.device.budget import DECODE
    from runner.generator import Generator
    from runner.sampling import SamplingParams

    for name, value in (("DDTREE_RUN_AHEAD", "1"), ("DDTREE_RUN_AHEAD_AUTO", "1" if queued else "0"),
                        ("DDTREE_LAZY_CONTEXT", "0")):  # fmt: skip
        monkeypatch.setenv(name, value)
    spec = SpecConfig(8, 16, extra_budgets=(8,))
    ranks = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=2)
    generator, batch = Generator(ranks), ranks.lead.batch
    launches, launch = [], batch.launch

    def spy(count, budget=None, report=True):  # (budget, whether it was queued behind a step in flight)
        launches.append((budget, bool(batch.in_flight)))
        return launch(count, budget, report)

    batch.launch = spy
    generator.measure_batch_costs(PROMPTS[0], SamplingParams(), rounds=1)
    behind = {budget: sum(q for b, q in launches if b == budget) for budget in (DECODE, 8, 16)}
    steps = {budget: sum(b == budget for b, _ in launches) for budget in (DECODE, 8, 16)}
    if queued:  # every choice's steps mostly queued behind another
        assert all(behind[b] * 2 > steps[b] for b in behind), (behind, steps)
    else:  # one step a job, each alone
        assert not any(behind.values()) and steps == {DECODE: 2, 8: 2, 16: 2}, (behind, steps)
    assert generator.batch_policy.seeded == {(c, b) for c in (1, 2) for b in (DECODE, 8, 16)}
    ranks.close()


def test_the_cpu_warm_up_times_a_batchs_choices_where_auto_can_be_asked_for(demo_ckpt):
    """On the CPU (no graphs to warm) the warm-up still times an all-`auto` batch's choices at each slot count
    (`Generator.measure_batch_costs`) where `auto` can be asked for: a server's warm-up, or a job whose requests take
    it (`enable_auto_budget`); then an `auto` batch's steps take no choice only to time it. A job that cannot ask for
    `auto` is not slowed by it."""
    from runner.device.budget import DECODE
    from runner.generator import Generator
    from runner.sampling import Sampler, SamplingParams
    from runner.speculate import generate_autoregressive

    GREEDY = SamplingParams()
    spec = SpecConfig(8, 16, extra_budgets=(4, 8))
    ranks = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=3)
    pairs = {(c, b) for c in (1, 2, 3) for b in (DECODE, 4, 8, 16)}
    plain = Generator(ranks)
    plain.warm_up()
    assert plain.batch_policy is None and "batch costs" not in plain.warm_up_phases
    for serving in (True, False):
        generator = Generator(ranks)
        if not serving:
            generator.enable_auto_budget()
        generator.warm_up(serving=serving)
        policy = generator.batch_policy
        assert "batch costs" in generator.warm_up_phases and policy.seeded == pairs
        timing, choose = [], policy.choose

        def spy(busy=1, count=1, policy=policy, choose=choose, timing=timing):
            budget = choose(busy, count)
            timing.append(policy.timing)
            return budget

        policy.choose = spy
        results = generator.generate_many(PROMPTS[:3], 16, [GREEDY] * 3, budget="auto")
        for prompt, result in zip(PROMPTS, results):
            assert result.tokens == generate_autoregressive(ranks, prompt, 16, Sampler(GREEDY)).tokens
        assert timing and not any(timing)
    ranks.close()


def test_a_batchs_trees_built_in_one_launch_under_the_interpreter_stay_lossless(demo_ckpt):
    """The GPU's tree build in a batched step, under the Triton interpreter: every slot's tree in one launch
    (`build_trees_kernel`) at a fixed narrower budget, at an `auto` batch's budgets (ranked for every slot) and at each
    slot's own (mixed budgets: each slot chooses from its tree); each request's greedy tokens are autoregressive
    decoding's. (The draft top-k stays the tensor-op form here: its kernel has its own test, and the interpreter takes
    seconds a call.)"""
    script = f"""
        from pathlib import Path
        from unittest import mock
        import runner.device.batch as batch_module
        import runner.device.loop as loop_module
        from engines.spec import BuildConfig, SpecConfig
        from runner.budget import BudgetPolicy
        from runner.device.budget import DECODE, ScriptedPolicy
        from runner.device.tree import top_logprobs
        from runner.device.tree_kernel import build_tree_kernel, build_trees_kernel
        from runner.generator import Generator
        from runner.sampling import Sampler, SamplingParams
        from runner.speculate import generate_autoregressive
        from tests.conftest import ENGINE_LIMITS, cpu_ranks
        from tests.test_batching import PROMPTS
        launches = []
        def trees(top, ids, budget, roots, rows, pad_token=0):
            launches.append((top.shape[0], budget, rows))
            return build_trees_kernel(top, ids, budget, roots, rows, pad_token)
        forms = lambda device: (top_logprobs, build_tree_kernel)
        with mock.patch.object(loop_module, "tree_forms", forms), \\
                mock.patch.object(batch_module, "batched_tree_form", lambda device: trees):
            ranks = cpu_ranks(Path({str(demo_ckpt(1))!r}), SpecConfig(8, 16, extra_budgets=(8,)),
                              BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=3)
            generator, greedy = Generator(ranks), SamplingParams()
            generator.policy = BudgetPolicy((8, 16), {{8: 1.0, 16: 1.5}})  # `auto` slots' costs, not measured here
            want = [generate_autoregressive(ranks, p, 6, Sampler(greedy)).tokens for p in PROMPTS[:3]]
            for budget in (8, "auto", [8, 16, "auto"]):
                launches.clear()
                policy = ScriptedPolicy((16, 8, DECODE)) if budget == "auto" else None
                results = generator.generate_many(PROMPTS[:3], 6, [greedy] * 3, budget=budget, batch_policy=policy)
                assert [r.tokens for r in results] == want, (budget, [r.tokens for r in results], want)
                assert launches and {{n for n, _, _ in launches}} <= {{1, 2, 3}}, launches
                if budget == 8:
                    assert {{(b, r) for _, b, r in launches}} == {{(8, 9)}}, launches
                print(budget, launches)
            ranks.close()
        print("ok")
    """
    done = run_interpreted(script, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "ok"


def test_the_gpu_forms_attend_per_request_under_the_interpreter(demo_ckpt):
    """The GPU forms inside a batched forward (the Triton TreeAttention kernel in the GPU MLA form, the drafter
    attention kernel), under the Triton interpreter: two requests' rows in one forward give each request's own
    forward."""
    script = f"""
        import torch
        from models.mla import InPlaceAbsorbedMLA
        from models.ops import ModelOps
        from models.parallel import SingleRank
        from models.presets import preset
        from models.rope import Rotary
        from models.loader import load_rank_models
        from plugins.tree_attention.kernel import tree_attention_cuda
        from plugins.tree_attention.reference import tree_attention
        from tests.interpreter import use_small_draft_kernel
        gen = torch.Generator().manual_seed(0)
        target = preset("kimi-rank", smoke=True).target
        mla = InPlaceAbsorbedMLA(target, 0, ModelOps(tree_attention_cuda, SingleRank()))
        with torch.no_grad():
            for p in mla.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5 + (1 if p.dim() == 1 else 0))
        mla.prepare_weights()
        rotary = Rotary(target.rope, target.qk_rope_head_dim)
        rows, lengths = 5, [23, 9]
        x = torch.randn(2 * rows, target.hidden_size, generator=gen)
        positions = torch.cat([torch.arange(n, n + rows) for n in lengths])
        cos, sin = rotary(positions, x.dtype)
        caches = [torch.randn(40, target.latent_dim, generator=gen) for _ in lengths]
        masks = torch.stack([torch.ones(rows, rows, dtype=torch.bool).tril()] * 2)
        masks[1, -1, 1:-1] = False
        worst = 0.0
        with torch.no_grad():
            got, got_kv = mla(x, cos, sin, masks, torch.stack(caches), torch.tensor(lengths))
            for b in range(2):
                s = slice(b * rows, (b + 1) * rows)
                want, want_kv = mla(x[s], cos[s], sin[s], masks[b], caches[b], torch.tensor([lengths[b]]))
                worst = max(worst, float((got[s] - want).norm() / want.norm()), float((got_kv[s] - want_kv).norm()))
        _, _, drafter = load_rank_models({str(demo_ckpt(1))!r}, 0, ModelOps(tree_attention, SingleRank()))
        use_small_draft_kernel()
        d = drafter.layers[0].self_attn
        cache = [torch.randn(len(drafter.layers), 2, 64, d.kv_heads, d.head_dim, generator=gen) for _ in range(2)]
        context = torch.randn(16, drafter.fc.weight.shape[1], generator=gen)
        block = torch.tensor([17] + [3] * 7 + [40] + [3] * 7)
        positions = torch.cat([torch.arange(30, 38), torch.arange(10, 18)])
        block_positions = torch.cat([torch.arange(33, 41), torch.arange(12, 20)])
        with torch.no_grad():
            logits, kv = drafter(context, positions, torch.tensor([3, 2]), block, block_positions, torch.stack(cache),
                                 torch.tensor([30, 10]))
            for b, (count, length) in enumerate(((3, 30), (2, 10))):
                s = slice(8 * b, 8 * (b + 1))
                want, want_kv = drafter(context[s], positions[s], torch.tensor([count]), block[s],
                                        block_positions[s], cache[b], torch.tensor([length]))
                worst = max(worst, float((logits[7 * b : 7 * (b + 1)] - want).norm() / want.norm()),
                            float((kv[:, :, s] - want_kv).norm()))
        print("worst", worst)
        assert worst < 1e-5, worst
    """
    done = run_interpreted(script, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_slots_that_do_not_fit_are_a_clear_error():
    from runner.kv_cache import SequenceCache
    from runner.worker import check_slot_memory

    cache = SequenceCache((4, 1000, 64), (2, 2, 1000, 2, 16), torch.float32, "cpu")  # 1.024 + 0.512 MB a slot
    check_slot_memory(8, cache, 13_000_000, "cuda:0")  # 12.3 MB fit in 13
    with pytest.raises(ValueError, match=r"max_batch_size=16: 16 slots of caches for 1000 tokens each need 24.58 MB; "
                       r"13.00 MB is free on cuda:0 \(lower --max_batch_size"):  # fmt: skip
        check_slot_memory(16, cache, 13_000_000, "cuda:0")


def test_admissions_put_off_only_where_sharing_them_pays():
    """`Batcher.admit_now` under a backlog: with the batch's own measurements of one H100 (a lone admission 1.1 ms,
    sixteen together 2 ms, a step 1.6 ms, a request 40 steps) a freed slot's admission waits for the next steps' frees,
    at most `ADMIT_WAIT_STEPS` steps in a row; with two CPU cores' (sixteen together take what sixteen lone ones do)
    it never waits; nor without a backlog, an empty batch, a measurement missing, or `group_admissions` off."""
    from collections import deque

    from runner.device.batch import ADMIT_WAIT_STEPS, Batcher

    def batcher(lone, sixteen, step, stay, busy=15, group=True):
        b = Batcher(None, 16, group_admissions=group)
        b.admission_times = {1: deque([lone] * 3), 16: deque([sixteen])}
        b.step_times, b.stays = deque([step] * 3), deque([stay] * 3)
        b.members = {slot: object() for slot in range(busy)}
        return b

    gpu = batcher(1.1e-3, 2.0e-3, 1.6e-3, 40)
    assert gpu.shared_admission_seconds() == pytest.approx(1.1e-3 - 0.9e-3 / 15)
    assert [gpu.admit_now(48) for _ in range(ADMIT_WAIT_STEPS + 1)] == [False] * ADMIT_WAIT_STEPS + [True]
    assert gpu.put_off == 0
    assert batcher(1.1e-3, 2.0e-3, 1.6e-3, 40, busy=12).admit_now(48)  # four idle slots cost more than it saves
    assert batcher(1.1e-3, 2.0e-3, 1.6e-3, 40).admit_now(1)  # no backlog: nothing more to share it with
    assert batcher(1.1e-3, 2.0e-3, 1.6e-3, 40, group=False).admit_now(48)
    assert batcher(1.1e-3, 2.0e-3, 1.6e-3, 40, busy=0).admit_now(48)
    assert not batcher(1.1e-3, 2.0e-3, 1.6e-3, 40, busy=16).admit_now(48)  # no free slot
    cpu = batcher(16.5e-3, 340e-3, 60e-3, 22)
    assert cpu.shared_admission_seconds() == 0.0 and cpu.admit_now(48)
    untimed = batcher(1.1e-3, 2.0e-3, 1.6e-3, 40)
    untimed.admission_times.pop(16)
    assert untimed.shared_admission_seconds() is None and untimed.admit_now(48)


def test_admissions_put_off_leave_every_request_s_tokens_as_they_were(demo_ckpt, monkeypatch):
    """`DDTREE_GROUP_ADMISSIONS=1` with every admission worth sharing: a backlog of five requests through two slots
    waits for a second freed slot (the third and fourth requests admitted together: one admission fewer), and every
    request's tokens equal autoregressive decoding's."""
    from runner.device.batch import Batcher
    from runner.generator import Generator
    from runner.sampling import Sampler, SamplingParams
    from runner.speculate import generate_autoregressive

    GREEDY = SamplingParams()
    ranks = cpu_ranks(demo_ckpt(1), SpecConfig(8, 8), BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=2)
    generator, prompts = Generator(ranks), [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[0][:4], PROMPTS[1][2:]]
    expected = [generate_autoregressive(ranks, p, 12, Sampler(GREEDY)).tokens for p in prompts]
    made, decided = [], []
    for group in ("0", "1"):
        monkeypatch.setenv("DDTREE_GROUP_ADMISSIONS", group)
        batcher, admit_now = generator.batcher, Batcher.admit_now

        def spy(generator=generator, batcher=batcher):
            made.append(batcher())
            made[-1].shared_admission_seconds = lambda: 1.0  # every admission worth sharing
            return made[-1]

        def admit(self, waiting, admit_now=admit_now):
            now = admit_now(self, waiting)
            decided.append((self.group_admissions, not now and self.free > 0))  # (asked, put off)
            return now

        monkeypatch.setattr(generator, "batcher", spy)
        monkeypatch.setattr(Batcher, "admit_now", admit)
        lengths = [3, 6, 12, 12, 12]  # the first two end a few steps apart: the next two can share an admission
        results = generator.generate_many(prompts, lengths, [GREEDY] * len(prompts), budget=8)
        assert [r.tokens for r in results] == [e[:n] for e, n in zip(expected, lengths)]
        monkeypatch.undo()
    plain, grouped = made
    assert not plain.group_admissions and grouped.group_admissions
    assert (True, True) in decided and (False, True) not in decided  # put off only where asked to
    assert {k: len(t) for k, t in plain.admission_times.items()} == {2: 1, 1: 3}
    assert {k: len(t) for k, t in grouped.admission_times.items()} == {2: 2, 1: 1}
    summary = grouped.admission_summary()  # what the CLI's batch summary reports
    assert {k: v["admissions"] for k, v in summary.items()} == {1: 1, 2: 2}
    assert all(v["ms"] > 0 for v in summary.values())
    monkeypatch.setenv("DDTREE_GROUP_ADMISSIONS", "yes")
    with pytest.raises(ValueError, match=r"DDTREE_GROUP_ADMISSIONS: expected 0 or 1, got 'yes'"):
        generator.batcher()
    ranks.close()


@pytest.mark.parametrize("autoregressive", [False, True])
def test_lone_admissions_as_groups_of_one_decode_as_before(demo_ckpt, monkeypatch, autoregressive):
    """`DDTREE_LONE_AS_GROUP=1` (the default on GPUs): a request admitted alone prefills as a group of one
    (`prefill_group`: the target's rows, their latent write and the drafter's context in one forward, on GPUs one
    graph), not on the prefill profile; five requests through two slots (a sampled one among them) emit what they emit
    without it, and greedy ones what autoregressive decoding does."""
    from runner.generator import Generator
    from runner.sampling import Sampler, SamplingParams
    from runner.speculate import generate_autoregressive

    greedy, sampled = SamplingParams(), SamplingParams(1.0, top_k=20, seed=5)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[0][:4], PROMPTS[1][2:]]
    params, lengths = [greedy, sampled, greedy, greedy, greedy], [5, 9, 12, 7, 10]
    outputs, calls = {}, {}
    for switch in ("0", "1"):
        monkeypatch.setenv("DDTREE_LONE_AS_GROUP", switch)
        ranks = cpu_ranks(demo_ckpt(1), SpecConfig(8, 8), BuildConfig(**ENGINE_LIMITS), device_loop=True,
                          autoregressive=autoregressive, max_batch_size=2)  # fmt: skip
        worker, seen = ranks.lead, []
        assert worker.batch.lone_as_group == (switch == "1")
        for name in ("batch_prefill", "prefill_group"):
            original = getattr(worker, name)
            spy = lambda *a, name=name, original=original, seen=seen: seen.append(name) or original(*a)  # noqa: E731
            monkeypatch.setattr(worker, name, spy)
        results = Generator(ranks, autoregressive).generate_many(prompts, lengths, params)
        outputs[switch], calls[switch] = [r.tokens for r in results], seen
        if switch == "1":
            for prompt, n, p, tokens in zip(prompts, lengths, params, outputs[switch]):
                if p is greedy:
                    assert tokens == generate_autoregressive(ranks, prompt, n, Sampler(greedy)).tokens
        ranks.close()
    assert outputs["1"] == outputs["0"] and [len(t) for t in outputs["1"]] == lengths
    assert set(calls["1"]) == {"prefill_group"} and "batch_prefill" in calls["0"]
    monkeypatch.delenv("DDTREE_LONE_AS_GROUP")  # unset: on where graphs run (GPUs), so off here
    ranks = cpu_ranks(demo_ckpt(1), SpecConfig(8, 8), BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=2)
    assert not ranks.lead.batch.lone_as_group
    ranks.close()
    monkeypatch.setenv("DDTREE_LONE_AS_GROUP", "on")
    with pytest.raises(ValueError, match=r"DDTREE_LONE_AS_GROUP: expected 0 or 1 \(or unset: on where graphs run\), "
                                         r"got 'on'"):  # fmt: skip
        cpu_ranks(demo_ckpt(1), SpecConfig(8, 8), BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=2)


def test_the_batch_names_its_timed_calls_and_times_nested_ones_once(demo_ckpt, monkeypatch):
    """The benchmarks' events around the batch's calls (`BatchLoop.timed`, GPUs only: stand-in events here): one
    (what, start, end) a call, named by its kind, its slots and budget or its requests; a lone prefill inside an
    admission is not timed again; a step's end is marked before its tokens are read."""
    import runner.device.batch as batch_module
    from runner.generator import Generator
    from runner.sampling import SamplingParams

    marks = []
    monkeypatch.setattr(batch_module, "timing_event", lambda: marks.append(len(marks)) or marks[-1])
    ranks = cpu_ranks(demo_ckpt(1), SpecConfig(8, 8), BuildConfig(**ENGINE_LIMITS), device_loop=True, max_batch_size=2)
    batch = ranks.lead.batch
    assert batch.events is None  # no probes: nothing recorded
    batch.events = []
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    Generator(ranks).generate_many(prompts, [6, 3, 4], [SamplingParams()] * 3)
    names = [name for name, _, _ in batch.events]
    assert names[0] == "admission of 2" and names[1] == "load" and names[2] == "step of 2"
    assert "admission of 1" in names and set(names) <= {"admission of 2", "admission of 1", "load", "step of 2",
                                                         "step of 1", "move"}  # fmt: skip
    assert all(start < end for _, start, end in batch.events) and len(marks) == 2 * len(names)
    ranks.close()


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["ddtree", "autoregressive"])
def test_steps_queued_ahead_emit_what_steps_read_one_at_a_time(demo_ckpt, monkeypatch, autoregressive, tp_size):
    """`DDTREE_RUN_AHEAD=1` (the default on GPUs): the batch queues its next step before reading the tokens of the one
    in flight (`Batcher._next_plan`). Six requests through two slots (a sampled one; different lengths; an end
    token that ends requests in a step with the next one already queued, whose slot then computes that step for no
    one while a waiting request's admission reads it first) emit what they emit with it off, on every rank, and greedy
    ones what autoregressive decoding does. Steps are queued ahead only where nothing can end a request by its token
    count; the switch takes 0 or 1."""
    from runner.generator import Generator
    from runner.sampling import Sampler, SamplingParams
    from runner.speculate import generate_autoregressive

    greedy, sampled = SamplingParams(), SamplingParams(1.0, top_k=20, seed=5)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0][:4], PROMPTS[1][2:]]
    params, lengths = [greedy, greedy, sampled, greedy, greedy, greedy], [30, 9, 24, 28, 12, 20]
    spec, build = SpecConfig(8, 8), BuildConfig(**ENGINE_LIMITS)
    ranks = cpu_ranks(demo_ckpt(tp_size), spec, build, device_loop=True, autoregressive=autoregressive,
                      max_batch_size=2)  # fmt: skip
    reference = generate_autoregressive(ranks, PROMPTS[3], 28, Sampler(greedy)).tokens
    end = reference[10]  # ends the fourth request (at least) part-way, not at its token count
    ranks.close()
    outputs, queued = {}, {}
    for switch in ("0", "1"):
        monkeypatch.setenv("DDTREE_RUN_AHEAD", switch)
        ranks = cpu_ranks(demo_ckpt(tp_size), spec, build, device_loop=True, autoregressive=autoregressive,
                          max_batch_size=2)  # fmt: skip
        batch, behind = ranks.lead.batch, []
        assert batch.run_ahead == (switch == "1")

        def spy(*args, batch=batch, behind=behind, launch=batch.launch):  # the steps in flight at each launch
            behind.append(len(batch.in_flight))
            return launch(*args)

        monkeypatch.setattr(batch, "launch", spy)
        results = Generator(ranks, autoregressive).generate_many(prompts, lengths, params, end_ids={end})
        outputs[switch], queued[switch] = [r.tokens for r in results], sum(behind)
        for prompt, n, p, result in zip(prompts, lengths, params, results):
            if p is greedy:
                assert result.tokens == generate_autoregressive(ranks, prompt, n, Sampler(greedy), {end}).tokens
            steps = result.accept_lengths  # each step its request read once (none queued for no one)
            assert 1 + sum(steps[:-1]) < len(result.tokens) <= 1 + sum(steps)
            assert result.target_forwards == 1 + len(steps)
        assert not batch.in_flight and all(not w.batch.in_flight for w in ranks.workers)
        ranks.close()
    assert outputs["1"] == outputs["0"] and queued["0"] == 0 and queued["1"] > 0
    assert end in outputs["1"][3] and len(outputs["1"][3]) < 28
    monkeypatch.setenv("DDTREE_RUN_AHEAD", "yes")
    with pytest.raises(ValueError, match=r"DDTREE_RUN_AHEAD: expected 0 or 1 \(or unset: on where graphs run\), "
                                         r"got 'yes'"):  # fmt: skip
        cpu_ranks(demo_ckpt(1), spec, build, device_loop=True, max_batch_size=2)


def test_an_auto_batch_queued_ahead_chooses_one_step_behind_and_stays_lossless(demo_ckpt, monkeypatch):
    """`DDTREE_RUN_AHEAD_AUTO=1` (with `DDTREE_RUN_AHEAD=1` and `DDTREE_LAZY_CONTEXT=0`): an all-`auto`
    batch's steps are queued before the previous one's statistics are read, the batch policy choosing and learning
    (`StepBudgetPolicy`, untaught) one step behind; five greedy requests through two slots emit autoregressive
    decoding's tokens, every step the policy chose was run, and its steps' times and statistics were all recorded.
    Unset, the switch follows `DDTREE_RUN_AHEAD` (on here), 0 turns it off; with `lazy_context` on too (its
    autoregressive steps appending their rows, one behind a tree step committing them)."""
    from runner.generator import Generator
    from runner.sampling import Sampler, SamplingParams
    from runner.speculate import generate_autoregressive

    greedy = SamplingParams()
    spec, build = SpecConfig(8, 16, extra_budgets=(4, 8)), BuildConfig(**ENGINE_LIMITS)
    prompts, lengths = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0][:4]], [30, 18, 26, 22, 16]
    monkeypatch.setenv("DDTREE_RUN_AHEAD", "1")
    monkeypatch.setenv("DDTREE_RUN_AHEAD_AUTO", "0")
    ranks = cpu_ranks(demo_ckpt(1), spec, build, device_loop=True, max_batch_size=2)
    assert not ranks.lead.batch.run_ahead_auto  # 0: off
    expected = [generate_autoregressive(ranks, p, n, Sampler(greedy)).tokens for p, n in zip(prompts, lengths)]
    ranks.close()
    for lazy in ("0", "1"):
        if lazy == "0":
            monkeypatch.delenv("DDTREE_RUN_AHEAD_AUTO")  # unset: as DDTREE_RUN_AHEAD
        else:
            monkeypatch.setenv("DDTREE_RUN_AHEAD_AUTO", "1")
        monkeypatch.setenv("DDTREE_LAZY_CONTEXT", lazy)
        ranks = cpu_ranks(demo_ckpt(1), spec, build, device_loop=True, max_batch_size=2)
        batch, behind = ranks.lead.batch, []
        assert batch.run_ahead_auto and batch.lazy_context == (lazy == "1")

        def spy(*args, batch=batch, behind=behind, launch=batch.launch):
            behind.append(len(batch.in_flight))
            return launch(*args)

        monkeypatch.setattr(batch, "launch", spy)
        generator = Generator(ranks)
        generator.policy = object()  # the batch chooses: no single-request costs needed
        results = generator.generate_many(prompts, lengths, [greedy] * len(prompts), budget="auto")
        assert [r.tokens for r in results] == expected
        policy = generator.batch_policy
        assert sum(policy.chosen.values()) == len(behind)  # every choice stepped (none dropped with a queued step)
        assert sum(len(t) for t in policy.times.values()) + sum(policy.informed.values()) > 0
        assert sum(behind) > 0
        if lazy == "0":  # the loop's own step refuses to run behind a queued one (it would read that one's tokens)
            generator.admit(generator.batcher(), prompts[0], 30, budget=8)
            batch.launch(1, 8, False)
            with pytest.raises(RuntimeError, match="a batched step with 1 queued ahead: collect them first"):
                batch.step(1, 8)
        ranks.close()
    monkeypatch.setenv("DDTREE_RUN_AHEAD_AUTO", "on")
    message = r"DDTREE_RUN_AHEAD_AUTO: expected 0 or 1 \(or unset: as DDTREE_RUN_AHEAD\), got 'on'"
    with pytest.raises(ValueError, match=message):
        cpu_ranks(demo_ckpt(1), spec, build, device_loop=True, max_batch_size=2)
