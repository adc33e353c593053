"""Cache-aware routing across real local endpoints: a prefix group stays on one endpoint,
and spills to the least loaded one when its endpoint is overloaded."""

import json
import random

import pytest

from carpool.client.affinity import Affinity, prefix_keys
from carpool.jobs.python_api.run import run_batch
from carpool.testing.fault_server import FaultConfig, ThreadedFaultServer
from carpool.testing.fixtures import started_servers


@pytest.fixture
def servers():
    with started_servers(ThreadedFaultServer) as start:
        yield start


def write_docs(path, docs, questions, seed=0):
    rows = [{"custom_id": f"d{d}q{q}", "temperature": 0, "max_tokens": 4, "messages": [
        {"role": "user", "content": f"Document {d}: " + " ".join(f"w{d}x{i}" for i in range(300))
         + f"\nQuestion {q}: what about item {q * 7}?"}]} for d in range(docs) for q in range(questions)]
    random.Random(seed).shuffle(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def homes(*srvs):
    """document -> the servers that answered any of its questions."""
    where: dict[str, set[int]] = {}
    for i, s in enumerate(srvs):
        for cid in s.server.seen:
            where.setdefault(cid.split("q")[0], set()).add(i)
    return where


def test_a_group_stays_on_one_endpoint_and_hits_its_cache(servers, tmp_path):
    a, b = servers(FaultConfig(prefix_cache_blocks=100_000)), servers(FaultConfig(prefix_cache_blocks=100_000))
    src = tmp_path / "in.jsonl"
    write_docs(src, docs=20, questions=4)
    # Order off: the shuffled file reaches the balancer as it is, so only routing keeps groups together.
    s = run_batch(src, tmp_path / "out.jsonl", endpoints=[a.url, b.url], model="m", cache="off",
                  concurrency=4, prefix_order=False)
    assert s["ok"] == 80
    where = homes(a, b)
    assert len(where) == 20 and all(len(v) == 1 for v in where.values())
    assert a.server.total_requests > 10 and b.server.total_requests > 10  # new groups still spread
    routed_hits = a.server.prefix_hits + b.server.prefix_hits

    c, d = servers(FaultConfig(prefix_cache_blocks=100_000)), servers(FaultConfig(prefix_cache_blocks=100_000))
    run_batch(src, tmp_path / "out2.jsonl", endpoints=[c.url, d.url], model="m", cache="off",
              concurrency=4, prefix_order=False, prefix_routing=False)
    assert sum(len(v) == 2 for v in homes(c, d).values()) >= 5  # by load alone groups are split
    assert routed_hits > c.server.prefix_hits + d.server.prefix_hits


def test_an_overloaded_endpoint_sheds_its_group_to_the_least_loaded(servers, tmp_path):
    # One group only: by affinity all of it would go to one endpoint; answers take a while,
    # so requests pile up there past the slack and the rest goes to the other endpoint.
    a = servers(FaultConfig(latency_s=0.2))
    b = servers(FaultConfig(latency_s=0.2))
    src = tmp_path / "in.jsonl"
    write_docs(src, docs=1, questions=40)
    s = run_batch(src, tmp_path / "out.jsonl", endpoints=[a.url, b.url], model="m", cache="off",
                  concurrency=16)
    assert s["ok"] == 40
    n = sorted([a.server.total_requests, b.server.total_requests])
    assert n[0] >= 5 and n[1] > n[0]  # both served; the group's own endpoint more


def test_affinity_slack_and_short_prompts():
    class Ep:
        def __init__(self, outstanding):
            self.outstanding, self.weight = outstanding, 1.0

    x, y = Ep(0), Ep(0)

    def least(eps):
        return min(eps, key=lambda e: e.outstanding)

    aff = Affinity(abs_slack=2, rel_slack=0.0)
    body = {"messages": [{"role": "user", "content": "z" * 3000 + "?"}]}
    keys = prefix_keys(body)
    assert len(keys) == 2 and keys == prefix_keys({"messages": [{"role": "user", "content": "z" * 3000 + "!!"}]})
    assert prefix_keys({"messages": [{"role": "user", "content": "short"}]}) == ()
    first = aff.choose(keys, [x, y], least)
    first.outstanding = 2
    assert aff.choose(keys, [x, y], least) is first  # within the slack: stays
    first.outstanding = 3
    assert aff.choose(keys, [x, y], least) is not first  # past it: the least loaded
    first.outstanding = 0
    assert aff.choose(keys, [x, y], least) is first  # the group kept its endpoint
