"""The step's token budget and sequences: chosen for throughput from timed whole steps (offline
engines), given by the user (always wins), or kept short by a server (they bound the time to a
first token and between two tokens)."""

from __future__ import annotations

import urllib.request

import torch

from carpool.engine import LLM, EngineConfig, GenerateRequest, SamplingParams
from carpool.engine.ops import Kernels
from carpool.engine.plan import (
    BATCH_TOKENS,
    DEFAULT_MAX_SEQS,
    SEQ_CHOICES,
    Plan,
    choose,
    choose_batch_tokens,
    choose_max_seqs,
)


def steps(fixed: float, per_row: float, chunk: int = 128, many: int = 4, max_tokens: int = 16384) -> dict:
    return {"chunk": chunk, "one": 1, "many": many, "seconds_one": fixed + per_row * chunk,
            "seconds_many": fixed + per_row * chunk * many, "max_tokens": max_tokens}


def test_the_budget_grows_while_the_per_step_cost_still_shows_per_token():
    # A step's fixed cost worth 30 rows (a CPU whose rows are slow): 2048 is within 3% of 16384.
    assert choose_batch_tokens(steps(fixed=0.030, per_row=0.001)) == 2048
    # Worth 400 rows (fast matrix units, the same per-step work): 2048 pays ~18% a token over 16384's
    # cost, 4096 ~7%, 8192 ~2.4%.
    assert choose_batch_tokens(steps(fixed=0.040, per_row=0.0001)) == 8192
    # Worth 2000 rows: only the largest is within 3% of itself.
    assert choose_batch_tokens(steps(fixed=0.200, per_row=0.0001)) == 16384


def test_memory_bounds_the_budget_and_bad_timings_choose_nothing():
    assert choose_batch_tokens(steps(fixed=0.200, per_row=0.0001, max_tokens=4096)) == 4096
    assert choose_batch_tokens(steps(fixed=0.200, per_row=0.0001, max_tokens=1000)) == BATCH_TOKENS[0]
    assert choose_batch_tokens({**steps(0.1, 0.001), "seconds_many": 0.0}) == 0
    assert choose_batch_tokens({"chunk": 128}) == 0
    assert choose({"budget": steps(fixed=0.200, per_row=0.0001)}).batch_tokens == 16384
    assert choose({}).batch_tokens == 0


def decode_steps(fixed: float, per_row: float) -> dict:
    return {"seconds": {str(n): fixed + per_row * n for n in SEQ_CHOICES}}


def test_more_sequences_run_at_once_only_where_the_step_s_shared_cost_still_shows_per_token():
    # A step's shared cost worth 2 rows: 64 rows pay 2.3% a token over 256's, within the margin.
    assert choose_max_seqs(decode_steps(fixed=0.002, per_row=0.001)) == 64
    # Worth 40 rows (fast matrix units: the weights read once a step dominate): 64 pays 41% a token
    # more than 256, 128 14%: only 256 is within the margin.
    assert choose_max_seqs(decode_steps(fixed=0.040, per_row=0.001)) == 256
    # Worth 6 rows: 64 pays 7% more than 256, 128 2.3%.
    assert choose_max_seqs(decode_steps(fixed=0.006, per_row=0.001)) == 128
    # Timed points in any order, as the plan file's JSON keeps them; the fewest that do as well win.
    assert choose_max_seqs({"seconds": {"256": 0.256, "64": 0.064, "128": 0.128}}) == 64


def test_bad_decode_timings_choose_no_sequences_and_the_plan_keeps_its_own():
    assert choose_max_seqs({}) == 0
    assert choose_max_seqs({"seconds": {"64": 0.0}}) == 0
    assert choose_max_seqs({"seconds": "x"}) == 0
    assert choose({}).max_seqs == 0
    assert choose({"seqs": decode_steps(fixed=0.040, per_row=0.001)}).max_seqs == 256
    plan = choose({"seqs": decode_steps(fixed=0.006, per_row=0.001)})
    assert Plan.from_json(plan.to_json()).max_seqs == 128


def _stats(tiny, h, budget, plan):
    _, loaded = tiny
    llm = LLM(h.engine_config(dtype="bfloat16", max_num_batched_tokens=budget,
                              extra={"attention": "kernel", "plan": plan}), loaded=loaded)
    req = GenerateRequest(request_id="r", prompt_token_ids=[5, 6, 7],
                          params=SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(llm.generate([req])[0].token_ids) == 2
    st = llm.engine.stats()
    return st["max_num_batched_tokens"], st["batch_tokens_source"]


def _seats(tiny, h, seqs, plan):
    _, loaded = tiny
    llm = LLM(h.engine_config(dtype="bfloat16", max_num_seqs=seqs, extra={"attention": "kernel", "plan": plan}),
              loaded=loaded)
    st = llm.engine.stats()
    return st["max_num_seqs"], st["max_num_seqs_source"]


def test_an_offline_engine_runs_the_plans_sequences_and_given_ones_win(tiny, h, kernels):
    assert _seats(tiny, h, None, "max_seqs=256") == (256, "measured")
    assert _seats(tiny, h, 12, "max_seqs=256") == (12, "set")
    assert _seats(tiny, h, None, "default") == (DEFAULT_MAX_SEQS, "default")


def test_an_offline_engine_runs_the_plans_budget_and_a_given_one_wins(tiny, h, kernels):
    assert _stats(tiny, h, None, "batch_tokens=8192") == (8192, "measured")
    assert _stats(tiny, h, 300, "batch_tokens=8192") == (300, "set")
    assert _stats(tiny, h, None, "default") == (2048, "default")


def test_the_measured_plan_times_whole_steps_on_its_routes(tiny, h, kernels, monkeypatch, tmp_path):
    """A plan measured by a real engine holds the two step timings and a budget it chose from them."""
    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path))
    _, loaded = tiny
    k = Kernels()  # the tmp cache: a copy of the session's build, so only the plan is new
    k.module, k.isa, k.has_bf16_gemm, k.has_int8_gemm = (kernels.module, kernels.isa, kernels.has_bf16_gemm,
                                                         kernels.has_int8_gemm)
    from carpool.engine.model import LlamaModel
    from carpool.engine.model_runner import ModelRunner

    model = LlamaModel(loaded.config, loaded.state_dict, torch.bfloat16)
    runner = ModelRunner(model, 64, 16, kernels="off", plan="remeasure")
    runner.ensure_plan(k)
    budget = model.plan.timings["budget"]
    assert 0 < budget["seconds_one"] <= budget["seconds_many"] * 1.5
    assert model.plan.batch_tokens in BATCH_TOKENS
    decode = model.plan.timings["seqs"]["seconds"]
    assert sorted(int(n) for n in decode) == list(SEQ_CHOICES)
    assert 0 < decode["64"] <= decode["256"] * 1.5  # a step of more rows never takes much less
    assert model.plan.max_seqs in SEQ_CHOICES


def test_a_server_keeps_a_short_budget_and_says_so(tiny):
    from carpool.server.config import ServerConfig
    from carpool.server.launcher import start_server

    engine = EngineConfig(model="tiny-random", max_num_seqs=4, num_kv_blocks=64, extra={"plan": "batch_tokens=8192"})
    with start_server(ServerConfig(engine=engine, port=0, embedding_model=None)) as srv:
        text = urllib.request.urlopen(srv.base_url + "/metrics", timeout=30).read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("carpool:max_num_batched_tokens"))
    assert float(line.rsplit(" ", 1)[1]) == 2048


def test_a_server_keeps_its_default_sequences_whatever_the_plan_measured(tiny):
    from carpool.engine.config import SERVER_MAX_NUM_SEQS
    from carpool.server.config import ServerConfig
    from carpool.server.launcher import start_server

    engine = EngineConfig(model="tiny-random", num_kv_blocks=64, extra={"plan": "max_seqs=256"})
    with start_server(ServerConfig(engine=engine, port=0, embedding_model=None)) as srv:
        text = urllib.request.urlopen(srv.base_url + "/metrics", timeout=30).read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("carpool:max_num_seqs"))
    assert float(line.rsplit(" ", 1)[1]) == SERVER_MAX_NUM_SEQS


def test_engines_of_any_max_num_seqs_read_one_plan(tiny, h, kernels):
    """The plan holds for every max_num_seqs (it chooses the offline one): an engine given other
    sequences than the last reads the plan that engine measured or read, and measures nothing."""
    _, loaded = tiny
    plans = [LLM(h.engine_config(dtype="bfloat16", max_num_seqs=n, extra={"attention": "kernel"}),
                 loaded=loaded).engine.model.plan for n in (4, 9)]
    assert plans[1].source == "cached"
    assert plans[1].fingerprint == plans[0].fingerprint
