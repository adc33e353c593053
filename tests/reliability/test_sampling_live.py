"""Random sampling parameters against a live `carpool serve`.

The reported repro: ``temperature`` 1e-300 (or 1e-40, NaN) or ``top_k`` 10^30 made the engine
fail for good (503 ``engine_failed`` to every later request and /health).  The engine side
landed with tests/engine/test_sampling_safety.py; this drives the whole server: hypothesis
sends bodies with NaN, infinities, subnormals, negative zero and huge integers in every
sampling field.  Every answer is a 200 or a 4xx OpenAI error body, never a 5xx, and after
each one /health is OK; at the end a plain request still gets its completion.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.server import ServerConfig, start_server

floats = (st.floats(allow_nan=True, allow_infinity=True)
          | st.sampled_from([0.0, -0.0, 1e-300, 1e-40, 5e-324, 1e-8, 1e38, 3.5e38, -1e-300, 2.0, 100.0])
          | st.floats(min_value=-3, max_value=3))
ints = (st.integers(-(2**70), 2**70) | st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30, 49151, 49152])
        | st.integers(-5, 50))
SAMPLING = {
    "temperature": floats, "top_p": floats, "top_k": ints | floats, "min_p": floats, "seed": ints,
    "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats,
    "min_tokens": ints, "max_tokens": st.integers(1, 3), "n": st.integers(1, 2),
    "logit_bias": st.dictionaries(st.integers(-5, 60000).map(str), floats, max_size=3),
    "logprobs": st.booleans(), "top_logprobs": ints,
}


@st.composite
def sampling_bodies(draw) -> bytes:
    keys = draw(st.lists(st.sampled_from(sorted(SAMPLING)), min_size=1, max_size=6, unique=True))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body |= {k: draw(SAMPLING[k]) for k in keys}
    return json.dumps(body).encode()  # NaN / Infinity as Python writes them: the server's json accepts them


def post(url: str, raw: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=raw, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def healthy(base: str) -> bool:
    with urllib.request.urlopen(base + "/health", timeout=60) as r:
        return r.status == 200


@pytest.fixture(scope="module")
def live(tiny_engine, tiny_config):
    with start_server(ServerConfig(engine=tiny_config, port=0, embedding_model=None), engine=tiny_engine) as srv:
        yield srv


@pytest.mark.parametrize("body", [
    {"temperature": 1e-300}, {"temperature": 1e-40}, {"temperature": float("nan")},
    {"top_k": 10**30}, {"temperature": 5e-324, "top_k": 2**63}, {"top_p": float("inf")},
])
def test_the_issues_bodies_leave_the_engine_serving(live, body):
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}).encode()
    status, answer = post(live.base_url + "/v1/chat/completions", raw)
    assert status in (200, 400), (status, answer[:300])
    assert healthy(live.base_url)
    status, answer = post(live.base_url + "/v1/chat/completions",
                          b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}')
    assert status == 200, answer[:300]


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(raw=sampling_bodies())
def test_random_sampling_parameters_never_hurt_the_server(live, raw):
    status, answer = post(live.base_url + "/v1/chat/completions", raw)
    assert status < 500, (status, answer[:300], raw[:300])
    if status != 200:
        err = json.loads(answer)["error"]
        assert err["message"], err
    assert healthy(live.base_url)
