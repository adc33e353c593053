"""The balancer's weights and fallback tiers, and the endpoint dialects.

Real ``Balancer`` objects driven through ``pick`` / ``done`` as the HTTP backend drives them;
what reaches a server is checked end to end in tests/jobs/test_endpoints_file.py.
"""

import asyncio
import time
from collections import Counter

from carpool.client.balancer import Balancer
from carpool.client.endpoints import EndpointSpec, is_reasoning_model, plain_specs


def names(b: Balancer, n: int, hold: int = 0) -> Counter:
    """``n`` picks; each request is answered at once, or after ``hold`` later picks (in flight)."""
    got: Counter = Counter()
    flying = []
    for _ in range(n):
        ep = b.pick()
        got[ep.spec.name] += 1
        flying.append(ep)
        if len(flying) > hold:
            b.done(flying.pop(0), ok=True)
    return got


def test_weights_are_the_shares_idle_and_busy():
    specs = [EndpointSpec("http://a/v1", name="a", weight=3), EndpointSpec("http://b/v1", name="b", weight=1)]
    assert names(Balancer(specs), 400) == {"a": 300, "b": 100}
    busy = names(Balancer(specs), 400, hold=8)  # 8 in flight: least in flight per unit of weight
    assert 280 <= busy["a"] <= 320


def test_equal_weights_alternate():
    b = Balancer(["http://a/v1", "http://b/v1"])
    assert names(b, 10) == {"http://a/v1": 5, "http://b/v1": 5}


def test_fallback_only_while_every_primary_is_cooling_down():
    specs = [EndpointSpec("http://p1/v1", name="p1"), EndpointSpec("http://p2/v1", name="p2"),
             EndpointSpec("http://f/v1", name="f", priority=1)]
    b = Balancer(specs, cooldown_s=0.2)
    assert "f" not in names(b, 20)
    b.pick()
    b.done(b.endpoints[0], ok=False, endpoint_fault=True)
    assert names(b, 6) == {"p2": 6}  # one primary cooling: the other primary, not the fallback
    b.pick()
    b.done(b.endpoints[1], ok=False, endpoint_fault=True)
    assert names(b, 4) == {"f": 4}  # every primary out: the fallback
    time.sleep(0.25)
    assert "f" not in names(b, 6)  # back after the cool-down


def test_an_endpoint_out_of_its_own_budget_is_passed_over():
    specs = [EndpointSpec("http://a/v1", name="a", rpm=6), EndpointSpec("http://b/v1", name="b")]
    b = Balancer(specs)
    first = b.pick()
    assert first.spec.name == "a" and first.budget is not None
    asyncio.run(first.budget.acquire(1, 0))  # what HttpBackend.call takes before sending
    b.done(first, ok=True)
    assert names(b, 5) == {"b": 5}


def test_dialects():
    az = plain_specs(["https://res.openai.azure.com/"], "k", {"X-A": "1"}, api_version="2025-01-01")[0]
    assert az.kind == "azure" and az.headers == {"api-key": "k", "X-A": "1"}
    assert az.request_url("/chat/completions", "dep") == "https://res.openai.azure.com/openai/deployments/dep/chat/completions"
    assert az.params == {"api-version": "2025-01-01"}
    oa = plain_specs(["http://127.0.0.1:8000/v1"], "k")[0]
    assert oa.headers == {"Authorization": "Bearer k"} and oa.params == {}
    assert oa.request_url("/embeddings") == "http://127.0.0.1:8000/v1/embeddings"
    assert [m for m in ("o1", "o3-mini", "o4-mini-2025-04-16", "gpt-5", "gpt-5.1", "openai/o3", "gpt-4o",
                        "gpt-4.1", "llama-3-o1", "omni") if is_reasoning_model(m)] == \
        ["o1", "o3-mini", "o4-mini-2025-04-16", "gpt-5", "gpt-5.1", "openai/o3"]
