"""Scheduler and KV-cache invariants on a tiny random model."""

import time

import pytest

from carpool.engine import LLM, EngineError, GenerateRequest, LLMEngine, SamplingParams


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def reqs_for(ps, n=10):
    return [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p, params=greedy(n)) for i, p in enumerate(ps)]


def test_budgets_never_exceeded(tiny, h):
    _, loaded = tiny
    llm = LLM(h.engine_config(max_num_seqs=3, max_num_batched_tokens=24), loaded=loaded)
    steps = []
    llm.engine.add_step_listener(steps.append)
    outs = llm.generate(reqs_for(h.prompts(5, [10, 50, 7, 33, 80, 2, 19]), 6))
    assert all(len(o.token_ids) == 6 for o in outs)
    assert steps
    for s in steps:
        assert s["num_prefill_tokens"] + s["num_decode_tokens"] <= 24
        assert s["num_scheduled_seqs"] <= 3 and s["num_running"] <= 3
        assert set(s) >= {"num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting", "duration_s"}
    assert max(s["num_running"] for s in steps) == 3  # the seq budget is actually used


def test_preemption_then_resumption_gives_same_tokens(tiny, h):
    _, loaded = tiny
    ps = h.prompts(6, [30, 35, 28, 40])
    ref = [o.token_ids for o in LLM(h.engine_config(), loaded=loaded).generate(reqs_for(ps, 40))]
    for caching in (True, False):
        # 4 sequences of ~75 tokens need ~20 blocks of 16; give 10 so they must preempt.
        llm = LLM(h.engine_config(num_kv_blocks=10, enable_prefix_caching=caching), loaded=loaded)
        outs = llm.generate(reqs_for(ps, 40))
        assert [o.token_ids for o in outs] == ref
        stats = llm.engine.stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_free_kv_blocks"] == 10


def test_prefix_cache_hits_on_shared_system_prompt(tiny, h):
    _, loaded = tiny
    system = h.prompts(7, [48])[0]
    tails = h.prompts(8, [5, 9, 13, 3])
    ps = [system + t for t in tails]
    outs = {}
    for caching in (True, False):
        llm = LLM(h.engine_config(enable_prefix_caching=caching), loaded=loaded)
        first = llm.generate(reqs_for(ps[:1]))  # computes and caches the system prompt blocks
        rest = llm.generate(reqs_for(ps[1:]))
        outs[caching] = [o.token_ids for o in first + rest]
        stats = llm.engine.stats()
        if caching:
            assert stats["prefix_cache_hits"] >= 3 * 48  # 3 full blocks per later request
            assert all(o.usage.cached_tokens == 48 for o in rest)
            assert first[0].usage.cached_tokens == 0
        else:
            assert stats["prefix_cache_hits"] == 0
        assert stats["prefix_cache_queries"] == sum(len(p) for p in ps)
    assert outs[True] == outs[False]


def test_reset_prefix_cache_makes_the_same_prompts_compute_again(tiny, h):
    _, loaded = tiny
    llm = LLM(h.engine_config(), loaded=loaded)
    ps = h.prompts(10, [40, 37])
    first = llm.generate(reqs_for(ps))
    again = llm.generate(reqs_for(ps))
    assert [o.usage.cached_tokens for o in again] == [32, 32]  # whole blocks before the last token
    assert llm.reset_prefix_cache() >= 4
    assert llm.engine.block_manager.hash_to_block == {}
    fresh = llm.generate(reqs_for(ps))
    assert [o.usage.cached_tokens for o in fresh] == [0, 0]
    assert [o.token_ids for o in fresh] == [o.token_ids for o in first] == [o.token_ids for o in again]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_abort_frees_every_block(tiny, h):
    _, loaded = tiny
    eng = LLMEngine(h.engine_config(), loaded=loaded)
    for r in reqs_for(h.prompts(9, [40, 60, 20]), 50):
        eng.add_request(r)
    for _ in range(4):
        eng.step()
    assert eng.block_manager.num_free_blocks < eng.num_blocks
    deltas = [eng.abort_request(f"r{i}") for i in range(3)]
    assert [d.finish_reason for d in deltas] == ["abort"] * 3
    assert deltas[0].usage.prompt_tokens == 40
    assert not eng.has_unfinished()
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    assert all(b.ref_count == 0 for b in eng.block_manager.blocks)
    assert eng.abort_request("r0") is None


def finish_order(llm, requests):
    order = []
    eng = llm.engine
    for r in requests:
        eng.add_request(r)
    while eng.has_unfinished():
        order += [d.request_id for d in eng.step() if d.finished]
    return order


def test_priority_policy_lower_first_ties_by_arrival(tiny, h):
    _, loaded = tiny
    llm = LLM(h.engine_config(max_num_seqs=1, scheduling_policy="priority"), loaded=loaded)
    t = time.monotonic()
    pr = [3, 1, 2, 1, 0]
    rs = [GenerateRequest(request_id=f"p{i}", prompt_token_ids=[5 + i] * 4, params=greedy(2), priority=p,
                          arrival_time=t + i) for i, p in enumerate(pr)]
    assert finish_order(llm, rs) == ["p4", "p1", "p3", "p2", "p0"]


def test_fcfs_and_lof_order(tiny, h):
    _, loaded = tiny
    t = time.monotonic()
    arrivals = [t - 1, t - 5, t - 3]

    def make():
        # priorities that the priority policy would follow; fcfs and lof ignore them
        return [GenerateRequest(request_id=f"q{i}", prompt_token_ids=[9 + i] * 4, params=greedy(2), priority=-i,
                                arrival_time=a) for i, a in enumerate(arrivals)]

    for policy in ("fcfs", "lof"):
        llm = LLM(h.engine_config(max_num_seqs=1, scheduling_policy=policy), loaded=loaded)
        assert finish_order(llm, make()) == ["q1", "q2", "q0"]
    llm = LLM(h.engine_config(max_num_seqs=1, scheduling_policy="priority"), loaded=loaded)
    assert finish_order(llm, make()) == ["q2", "q1", "q0"]


def test_lof_favours_longest_total_wait_after_preemption(tiny, h):
    """fcfs keeps a preempted request's old place; lof ranks by the time actually spent waiting."""
    _, loaded = tiny
    for policy, winner in (("fcfs", "old"), ("lof", "new")):
        eng = LLMEngine(h.engine_config(scheduling_policy=policy, max_num_seqs=1), loaded=loaded)
        old = eng.make_sequence(GenerateRequest(request_id="old", prompt_token_ids=[1] * 4, params=greedy(2)))
        new = eng.make_sequence(GenerateRequest(request_id="new", prompt_token_ids=[2] * 4, params=greedy(2)))
        now = time.monotonic()
        # "old" arrived 20 s ago, waited 2 s, ran, and was preempted 1 s ago (3 s waited in all);
        # "new" arrived 5 s ago and has waited 5 s.  (Set before queueing: the queue orders on entry.)
        old.arrival_time, old.wait_accum, old.waiting_since = now - 20, 2.0, now - 1
        new.arrival_time, new.waiting_since = now - 5, now - 5
        eng.add_request(old)
        eng.add_request(new)
        eng.step()
        assert [s.request_id for s in eng.scheduler.running] == [winner]


def test_max_model_len_error_names_the_field(tiny, h):
    _, loaded = tiny
    eng = LLMEngine(h.engine_config(max_model_len=64), loaded=loaded)
    with pytest.raises(EngineError, match="max_model_len"):
        eng.add_request(GenerateRequest(request_id="x", prompt_token_ids=[1] * 60, params=greedy(10)))
    with pytest.raises(EngineError, match="max_tokens"):
        eng.add_request(GenerateRequest(request_id="y", prompt_token_ids=[1] * 6, params=greedy(0)))
    with pytest.raises(EngineError, match="prompt_token_ids"):
        eng.add_request(GenerateRequest(request_id="z", prompt_token_ids=[1, 9999], params=greedy(2)))
    with pytest.raises(EngineError, match="num_kv_blocks"):
        LLMEngine(h.engine_config(num_kv_blocks=2), loaded=loaded).add_request(
            GenerateRequest(request_id="w", prompt_token_ids=[1] * 40, params=greedy(2)))
    assert not eng.has_unfinished()


@pytest.mark.parametrize("policy", ["fcfs", "priority", "lof"])
def test_waiting_queue_pops_in_policy_order_through_removals_and_requeues(policy):
    """The heap gives the order the old per-step sort gave: the policy's key, then queue order."""
    import random

    from carpool.engine.scheduler import WaitingQueue
    from carpool.engine.sequence import Sequence

    rng = random.Random(3)
    q = WaitingQueue(policy)
    live: dict[int, tuple[Sequence, int]] = {}
    now = 1000.0
    for order in range(400):
        s = Sequence(f"s{order}", [1, 2, 3], greedy(1), 16, priority=rng.randint(0, 3),
                     arrival_time=now - rng.choice([1.0, 2.0, 3.0]))  # ties on purpose
        s.wait_accum = rng.choice([0.0, 0.5])
        s.waiting_since = s.arrival_time + rng.choice([0.0, 0.5])
        q.push(s, order)
        live[order] = (s, order)
        if rng.random() < 0.3:  # a removal (finish/abort) of a random waiting sequence
            gone = rng.choice(list(live))
            assert q.remove(live.pop(gone)[0])
    assert not q.remove(Sequence("never", [1], greedy(1), 16))

    def key(item):
        s, order = item
        if policy == "priority":
            return (s.priority, s.arrival_time, order)
        if policy == "lof":
            return (-s.current_wait(now), s.arrival_time, order)
        return (s.arrival_time, order)

    expected = [s for s, _ in sorted(live.values(), key=key)]
    assert len(q) == len(expected)
    assert list(q) == expected
    half = len(expected) // 2
    popped = [q.pop() for _ in range(half)]
    for s in popped[:5]:  # deferred and pushed back (the scheduler's one-step wait): first again
        q.push(s, next(order for order, (t, _) in live.items() if t is s))
    rest = [q.pop() for _ in range(len(q))]
    assert popped[5:] + rest == expected[5:half] + expected[:5] + expected[half:] and not q


def test_a_step_looks_at_a_bounded_part_of_a_huge_waiting_queue(tiny, h):
    """3000 identical prompts: the first computes the shared blocks, every other one would be
    deferred a step (engine-surface's rule); a step still looks at no more than max_num_seqs of
    them, not the whole queue, and every request ends with the same tokens."""
    _, loaded = tiny
    eng = LLMEngine(h.engine_config(max_num_seqs=8, num_kv_blocks=64), loaded=loaded)
    prompt = h.prompts(9, [40])[0]
    for i in range(3000):
        eng.add_request(GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=greedy(2)))
    looked = [0]
    match = eng.scheduler.bm.match_prefix

    def counting(seq):
        looked[0] += 1
        return match(seq)

    eng.scheduler.bm.match_prefix = counting
    eng.step()
    assert 1 <= looked[0] <= 8 + 1
    assert len(eng.scheduler.waiting) == 2999
    outs: dict[str, list[int]] = {}
    for _ in range(200):
        looked[0] = 0
        for d in eng.step():
            outs.setdefault(d.request_id, []).extend(d.token_ids)
        assert looked[0] <= 2 * 8 + 1
        if len(outs) >= 40:
            break
    assert len({tuple(v) for k, v in outs.items() if len(v) == 2}) == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_background_sits_out_the_steps_of_a_foreground_prompt(tiny, h, policy):
    """Background requests (the server's batches) are left out of every step that computes a
    foreground prompt, go on after it, and give the tokens they give alone."""
    from carpool.engine.protocol import BACKGROUND_PRIORITY

    _, loaded = tiny
    cfg = h.engine_config(scheduling_policy=policy, max_num_batched_tokens=32)
    ps = h.prompts(11, [12, 9, 14])
    alone = [o.token_ids for o in LLM(cfg, loaded=loaded).generate(reqs_for(ps, 12))]
    eng = LLMEngine(cfg, loaded=loaded)
    steps = []
    eng.add_step_listener(steps.append)
    bg = [GenerateRequest(request_id=f"bg{i}", prompt_token_ids=p, params=greedy(12), priority=BACKGROUND_PRIORITY)
          for i, p in enumerate(ps)]
    for r in bg:
        eng.add_request(r)
    tokens: dict[str, list[int]] = {}
    for _ in range(3):  # the background prompts are in, they decode
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    assert steps[-1]["num_decode_tokens"] == 3
    eng.add_request(GenerateRequest(request_id="fg", prompt_token_ids=[7] * 70, params=greedy(3)))
    fg_steps = []
    while eng.has_unfinished():
        before = len(steps)
        deltas = eng.step()
        for d in deltas:
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
        if any(d.request_id == "fg" for d in deltas) and len(tokens["fg"]) == 1:
            fg_steps.append(steps[before])
        if "fg" not in tokens:  # the foreground prompt is computed in chunks of 32: only it runs
            assert steps[before]["num_decode_tokens"] == 0 and steps[before]["num_scheduled_seqs"] == 1
    assert fg_steps and fg_steps[0]["num_scheduled_seqs"] == 1  # the step giving its first token: alone
    assert [tokens[f"bg{i}"] for i in range(3)] == alone  # they went on where they were
    assert len(tokens["fg"]) == 3


@pytest.mark.parametrize(("seats", "blocks", "warm"), [(3, 256, 8), (16, 12, 30)])
def test_a_foreground_request_takes_a_seat_or_blocks_from_background_work(tiny, h, seats, blocks, warm):
    """Background sequences that hold every seat (or the whole KV cache) for a long output do not
    make a foreground request wait for them: the last-ranked one is preempted, the foreground
    request gets its first token within a few steps, and the preempted sequence later gives the
    tokens it gives alone."""
    from carpool.engine.protocol import BACKGROUND_PRIORITY

    _, loaded = tiny
    cfg = h.engine_config(max_num_seqs=seats, num_kv_blocks=blocks, max_num_batched_tokens=64)
    ps = h.prompts(12, [20, 24, 18])
    alone_llm = LLM(cfg, loaded=loaded)
    alone = [o.token_ids for o in alone_llm.generate(reqs_for(ps, 40))]
    assert alone_llm.engine.scheduler.num_preemptions == 0  # they fit the engine by themselves
    eng = LLMEngine(cfg, loaded=loaded)
    for i, p in enumerate(ps):
        eng.add_request(GenerateRequest(request_id=f"bg{i}", prompt_token_ids=p, params=greedy(40),
                                        priority=BACKGROUND_PRIORITY))
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)

    for _ in range(warm):  # the background requests are in and decoding: all seats or blocks taken
        step()
    eng.add_request(GenerateRequest(request_id="fg", prompt_token_ids=[9] * 30, params=greedy(2)))
    waited = 0
    while "fg" not in tokens:
        step()
        waited += 1
        assert waited <= 3, "the foreground request waited for background work to finish"
    while eng.has_unfinished():
        step()
    assert eng.scheduler.num_preemptions >= 1
    assert [tokens[f"bg{i}"] for i in range(3)] == alone and len(tokens["fg"]) == 2


def test_background_prefill_is_computed_in_small_chunks(tiny, h):
    """A step holds at most BACKGROUND_CHUNK prompt tokens of background work (an online
    request arriving mid-step waits for that step), while a foreground prompt takes the whole
    token budget; the background tokens are the ones it gives alone."""
    from carpool.engine.protocol import BACKGROUND_PRIORITY
    from carpool.engine.scheduler import BACKGROUND_CHUNK

    _, loaded = tiny
    cfg = h.engine_config(max_num_batched_tokens=512)
    ps = h.prompts(12, [300, 200])
    alone = [o.token_ids for o in LLM(cfg, loaded=loaded).generate(reqs_for(ps, 4))]
    eng = LLMEngine(cfg, loaded=loaded)
    steps = []
    eng.add_step_listener(steps.append)
    for i, p in enumerate(ps):
        eng.add_request(GenerateRequest(request_id=f"bg{i}", prompt_token_ids=p, params=greedy(4),
                                        priority=BACKGROUND_PRIORITY))
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    assert steps and max(s["num_prefill_tokens"] for s in steps) == BACKGROUND_CHUNK
    assert [tokens["bg0"], tokens["bg1"]] == alone
    fresh = h.prompts(13, [300])[0]  # not in the prefix cache
    eng.add_request(GenerateRequest(request_id="fg", prompt_token_ids=fresh, params=greedy(1)))
    before = len(steps)
    while eng.has_unfinished():
        eng.step()
    assert steps[before]["num_prefill_tokens"] == 300  # the foreground prompt in one step


def test_a_background_step_stops_for_a_foreground_arrival_and_is_redone(tiny, h):
    """A step holding only background work stops at its next layer once the interrupt is set
    (a foreground request arrived): nothing of it is kept, it is redone later and the tokens —
    seeded samples included — are the ones the requests give uninterrupted.  At most
    MAX_INTERRUPTED_IN_ROW steps stop in a row, and a step holding foreground work never does."""
    import threading

    from carpool.engine.llm_engine import MAX_INTERRUPTED_IN_ROW
    from carpool.engine.protocol import BACKGROUND_PRIORITY

    _, loaded = tiny
    cfg = h.engine_config(max_num_batched_tokens=64)
    ps = h.prompts(14, [20, 37, 9])
    params = [greedy(6), SamplingParams(temperature=0.9, seed=5, max_tokens=6, ignore_eos=True), greedy(6)]

    def requests(priority):
        return [GenerateRequest(request_id=f"bg{i}", prompt_token_ids=p, params=sp, priority=priority)
                for i, (p, sp) in enumerate(zip(ps, params, strict=True))]

    alone = [o.token_ids for o in LLM(cfg, loaded=loaded).generate(requests(0))]
    eng = LLMEngine(cfg, loaded=loaded)
    steps = []
    eng.add_step_listener(steps.append)
    for r in requests(BACKGROUND_PRIORITY):
        eng.add_request(r)
    arrived = threading.Event()
    arrived.set()  # as if a foreground request kept arriving during every step
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for d in eng.step(arrived):
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    assert [tokens[f"bg{i}"] for i in range(3)] == alone
    stopped = [s["interrupted"] for s in steps]
    assert sum(stopped) == eng.stats()["num_interrupted_steps"] > 0
    assert all(s["num_scheduled_seqs"] == 0 and s["num_decode_tokens"] == 0 for s in steps if s["interrupted"])
    runs = "".join("x" if s else "." for s in stopped)
    assert "x" * (MAX_INTERRUPTED_IN_ROW + 1) not in runs and "." in runs

    eng.add_request(GenerateRequest(request_id="fg", prompt_token_ids=ps[0], params=greedy(3)))
    before = len(steps)
    while eng.has_unfinished():
        eng.step(arrived)
    assert not any(s["interrupted"] for s in steps[before:])  # foreground work is never stopped
