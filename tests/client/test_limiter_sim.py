"""The adaptive limiter against a simulated continuous-batching server (carpool/testing/batch_sim.py).

Deterministic: a fake clock and a scripted server, no sleeps and no wall-clock assertions.
The throughput and latency compared here are the simulation's, each adaptive run against
fixed limits on the same server and the same requests.
"""

from carpool.client.limiter import AdaptiveLimiter, FixedLimiter
from carpool.testing.batch_sim import BatchServerSim, FakeClock, long_requests, run, short_requests

FIXED = (8, 16, 32, 64, 96, 128, 256)


def cpu_server(**kw) -> BatchServerSim:
    """The shape of `carpool serve` on this machine: 64 sequences, a slow step."""
    return BatchServerSim(**{"max_num_seqs": 64, "step_s": 0.06, "decode_s": 0.0003, "prefill_s": 0.0003, **kw})


def vllm_like(**kw) -> BatchServerSim:
    return BatchServerSim(**{"max_num_seqs": 128, "step_s": 0.028, "decode_s": 0.0002, "prefill_s": 0.0002, **kw})


def adaptive_run(make_server, requests, events=None, stream=True, **lim_kw):
    clock = FakeClock()
    lim = AdaptiveLimiter(clock=clock, **lim_kw)
    return lim, run(lim, make_server(), requests, clock, events=events, stream=stream)


def fixed_runs(make_server, requests, events=None, stream=True, settings=FIXED):
    out = {}
    for n in settings:
        clock = FakeClock()
        out[n] = run(FixedLimiter(n, clock=clock), make_server(), requests, clock, events=events, stream=stream)
    return out


def best_of(fixed: dict):
    best = max(fixed, key=lambda n: fixed[n].throughput)
    return best, fixed[best]


def test_finds_the_throughput_knee_of_a_batching_server():
    # Latency grows with concurrency all the way (a bigger batch is a slower step), so a
    # latency-gradient limiter stops far below the knee; this one must reach the full batch
    # and stop there: throughput of the best fixed limit, P99 latency no worse.
    for make, reqs in ((cpu_server, short_requests(600, 1)), (cpu_server, long_requests(300, 2)),
                       (vllm_like, short_requests(600, 3)), (vllm_like, long_requests(400, 4))):
        lim, res = adaptive_run(make, reqs)
        n, best = best_of(fixed_runs(make, reqs))
        seqs = make().max_num_seqs
        case = (make.__name__, len(reqs), n)
        assert res.throughput >= 0.97 * best.throughput, (case, res.throughput, best.throughput)
        assert res.p99() <= 1.10 * best.p99(), (case, res.p99(), best.p99())
        assert lim.batch is not None and 0.8 * seqs <= lim.batch <= seqs, (case, lim.batch)
        assert seqs * 0.9 <= lim.limit <= 1.5 * seqs, (case, lim.limit)


def cpu_vllm(**kw) -> BatchServerSim:
    """`vllm serve` on 2 CPU cores: 128 sequences, each step costing ~6 ms a sequence, so the
    throughput is nearly flat from 32 up and a round trip at the full batch is ~20 s."""
    return BatchServerSim(**{"max_num_seqs": 128, "step_s": 0.02, "decode_s": 0.006, "prefill_s": 0.0009,
                             "token_budget": 4096, **kw})


def test_leaves_slow_start_on_a_server_whose_round_trip_is_long():
    # The first answers come back only after ~20 s: the batch must be seen full from the
    # first tokens alone, well before then, not after a few round trips (the first design
    # held 160 in flight, 25% queued, until 69% of this job was over).
    reqs = short_requests(300, 7)
    lim, res = adaptive_run(cpu_vllm, reqs)
    n, best = best_of(fixed_runs(cpu_vllm, reqs, settings=(32, 64, 128, 256)))
    assert lim.batch is not None and 120 <= lim.batch <= 128, lim.batch
    assert res.limit_at(0.45 * res.elapsed) <= 1.15 * 128, res.limits
    assert res.throughput >= 0.97 * best.throughput and res.p99() <= 1.10 * best.p99(), (n, res.p99(), best.p99())


def test_reaches_the_batch_within_the_first_few_percent_of_a_job():
    reqs = short_requests(2000, 5)
    _, res = adaptive_run(cpu_server, reqs)
    seqs = cpu_server().max_num_seqs
    t_full = next(t for t, limit in res.limits if limit >= seqs)
    answered_by_then = sum(1 for t, _ in res.limits[1:] if t <= t_full)  # one entry per completion
    assert answered_by_then <= 0.03 * len(reqs), answered_by_then


def test_a_slower_server_keeps_its_limit():
    # Another tenant halves the server's speed: latency doubles, but the batch that is best
    # for throughput is the same size, so the limit must not collapse.
    def slow(server):
        server.slowdown = 2.0

    lim, _ = adaptive_run(vllm_like, short_requests(600, 6), events={8.0: slow})
    assert lim.limit >= vllm_like().max_num_seqs
    assert lim.moves["server queue"] == 0


def test_follows_the_server_when_its_batch_shrinks_and_grows():
    def shrink(server):
        server.max_num_seqs = 16

    lim, res = adaptive_run(cpu_server, short_requests(900, 7), events={12.0: shrink})
    assert lim.limit <= 2.0 * 16, lim.limit  # down to the new batch and a short queue
    assert lim.batch == 16
    assert res.limit_at(11.0) >= 64
    # and back up when capacity returns (the other tenant leaves)
    lim2, res2 = adaptive_run(cpu_server, short_requests(1200, 8),
                              events={2.0: shrink, 40.0: lambda s: setattr(s, "max_num_seqs", 64)})
    assert res2.limit_at(35.0) <= 32
    assert lim2.limit >= 64, lim2.limit


def test_backs_off_on_429_without_a_storm():
    reqs = short_requests(600, 9)
    lim, res = adaptive_run(lambda: vllm_like(capacity=12), reqs)
    assert res.drops < 0.1 * len(reqs), res.drops
    assert lim.ceiling is not None and 12 <= lim.ceiling <= 14
    assert lim.limit <= 13 and lim.reason in ("429s", "429 probe")
    _, best = best_of(fixed_runs(lambda: vllm_like(capacity=12), reqs, settings=(6, 10, 12, 16, 24)))
    assert res.throughput >= 0.95 * best.throughput


def test_without_streaming_it_climbs_on_throughput():
    reqs = short_requests(900, 10)
    lim, res = adaptive_run(cpu_server, reqs, stream=False)
    _, best = best_of(fixed_runs(cpu_server, reqs, stream=False, settings=(16, 32, 64, 128)))
    assert lim.limit >= 32
    assert res.throughput >= 0.85 * best.throughput


def test_counts_decoding_and_says_why_it_moved():
    clock = FakeClock()
    lim = AdaptiveLimiter(initial=8, clock=clock)
    assert all(lim.try_acquire() for _ in range(8)) and not lim.try_acquire()
    for _ in range(8):
        clock.t += 0.1
        lim.first_token(clock.t)
    assert lim.decoding == 8
    snap = lim.snapshot()
    # 8 decode at once: the limit is that batch and half as many again waiting (+4)
    assert snap["limit"] == 16 and snap["phase"] == "start" and snap["reason"] == "slow start"
    assert snap["decoding"] == 8 and snap["in_flight"] == 8
    lim.release(e2e=1.0, ttft=0.1, tokens=30, decoding=True, completion_tokens=10)
    assert lim.decoding == 7 and lim.in_flight == 7
