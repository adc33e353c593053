"""The engine plan: routes chosen from injected timings (no clock here), the plan file trusted only
on the machine and torch it was measured on, and every route it can choose answering as
transformers does."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from carpool.engine import LLM, GenerateRequest, SamplingParams, cpu, plan_cache, plan_measure
from carpool.engine.ops import Kernels
from carpool.engine.plan import (
    UNBOUNDED,
    Plan,
    apply_overrides,
    choose,
    choose_decode,
    choose_gemm,
    choose_grain,
    choose_prefill,
    choose_weight_only,
    default_plan,
    parse_overrides,
    prefill_work,
    route_for,
)


def gemm_times(**by_rows: tuple[float, float]) -> dict[str, dict[str, float]]:
    """gemm_times(r16=(carpool s, onednn s), ...) -> {"16": {"carpool": .., "onednn": ..}}."""
    return {k[1:]: {"carpool": c, "onednn": o} for k, (c, o) in by_rows.items()}


# ----------------------------------------------------------------------------- choosing


def test_gemm_routes_follow_the_faster_route_per_row_bucket():
    plan = choose_gemm({"qkv": gemm_times(r16=(1.0, 2.0), r64=(4.0, 5.0), r256=(20.0, 10.0), r2048=(90.0, 80.0)),
                        "down": gemm_times(r16=(1.0, 2.0), r2048=(50.0, 80.0))})
    assert plan["qkv"] == ((64, "carpool"), (UNBOUNDED, "onednn"))
    assert plan["down"] == ((UNBOUNDED, "carpool"),)
    assert [route_for(plan["qkv"], r) for r in (1, 64, 65, 256, 5000)] == ["carpool"] * 2 + ["onednn"] * 3


def test_an_amx_like_machine_gets_onednn_everywhere():
    """oneDNN several times faster at every size (AMX tiles): it takes every linear and bucket."""
    t = {name: gemm_times(r16=(1.0, 0.9), r64=(4.0, 1.0), r256=(16.0, 3.0), r2048=(128.0, 20.0))
         for name in ("qkv", "o", "gate_up", "down")}
    plan = choose({"gemm": t, "int8_gemm": t})
    for name in t:
        assert plan.gemm_routes(name) == ((UNBOUNDED, "onednn"),)
        assert plan.gemm_routes(name, int8=True) == ((UNBOUNDED, "onednn"),)


def test_a_route_within_the_noise_margin_does_not_displace_the_first():
    plan = choose_gemm({"o": gemm_times(r16=(1.0, 0.99), r64=(1.0, 0.9))})
    assert plan["o"] == ((16, "carpool"), (UNBOUNDED, "onednn"))


def test_cutting_the_blocks_rows_wins_only_where_it_was_timed_faster():
    """Where the column blocks do not divide between the threads the plan also times the packed
    GEMM with each block's rows cut in pieces; that route takes the buckets it won by the margin."""
    t = {"16": {"carpool": 1.0, "carpool_split": 1.2, "onednn": 2.0},  # rows few: the weights re-read cost
         "256": {"carpool": 10.0, "carpool_split": 7.5, "onednn": 12.0},  # an idle thread cost more
         "1024": {"carpool": 40.0, "carpool_split": 39.5, "onednn": 45.0}}  # within the margin
    assert choose_gemm({"o": t})["o"] == ((16, "carpool"), (256, "carpool_split"), (UNBOUNDED, "carpool"))
    forced = apply_overrides(choose({"gemm": {"o": t}}), parse_overrides("int8_gemm=carpool_split"))
    assert forced.gemm_routes("o", int8=True) == ((UNBOUNDED, "carpool_split"),)


def test_a_route_that_was_not_timed_never_wins():
    assert choose_gemm({"o": {"64": {"onednn": 1.0}}})["o"] == ((UNBOUNDED, "onednn"),)
    assert choose_gemm({"o": {"64": {"carpool": 1.0, "onednn": float("nan")}}})["o"] == ((UNBOUNDED, "carpool"),)


def test_weight_only_limit_is_the_last_row_count_it_won_from_one_up():
    wo = {"1": {"weight_only": 1, "int8": 3}, "2": {"weight_only": 2, "int8": 3},
          "4": {"weight_only": 5, "int8": 3}, "8": {"weight_only": 1, "int8": 3}}
    assert choose_weight_only(wo) == 2  # 8 won again, but 4 lost: the line is at 2
    assert choose_weight_only({"1": {"weight_only": 2, "int8": 1}}) == 0


def point(rows: int, cached: int, kernel: float, flash: float, brgemm: float | None = None) -> dict:
    out = {"rows": rows, "cached": cached, "kernel": kernel, "flash": flash}
    return out if brgemm is None else {**out, "brgemm": brgemm}


def test_prefill_routes_follow_the_fastest_route_per_bucket_of_work():
    pts = [point(64, 0, 1, 2), point(128, 144, 3, 2), point(512, 0, 30, 40), point(1024, 0, 90, 50),
           point(2048, 0, 300, 100)]
    work = [prefill_work(p["rows"], p["cached"]) for p in pts]
    assert choose_prefill(pts) == ((work[0], "kernel"), (work[1], "flash"), (work[2], "kernel"), (UNBOUNDED, "flash"))
    assert choose_prefill([point(64, 0, 1, 2), point(2048, 0, 1, 2)]) == ((UNBOUNDED, "kernel"),)
    # The brgemm GEMMs where timed (an AMX-like machine: they win from mid-sized chunks on), never where not.
    amx = [point(64, 0, 1, 2, 1.2), point(512, 0, 30, 12, 8), point(2048, 0, 300, 100, 40)]
    assert choose_prefill(amx) == ((64 * 32, "kernel"), (UNBOUNDED, "brgemm"))
    assert choose_prefill([point(64, 0, 2, 1, float("nan"))]) == ((UNBOUNDED, "flash"),)


def test_decode_route_is_brgemm_only_where_it_won_by_the_margin():
    pts = [{"rows": 32, "keys": 64, "kernel": 1.0, "brgemm": 0.99},
           {"rows": 32, "keys": 1024, "kernel": 3, "brgemm": 2}, {"rows": 32, "keys": 2048, "kernel": 6, "brgemm": 4}]
    assert choose_decode(pts) == ((64, "kernel"), (UNBOUNDED, "brgemm"))
    assert choose({"decode": pts}).decode == ((64, "kernel"), (UNBOUNDED, "brgemm"))
    assert choose({}).decode == ((UNBOUNDED, "kernel"),)


def test_parts_not_timed_keep_the_fallback_plan():
    fallback = default_plan(has_amx=True)
    plan = choose({"gemm": {"qkv": gemm_times(r16=(2.0, 1.0))}}, fallback)
    assert plan.gemm_routes("qkv") == ((UNBOUNDED, "onednn"),)
    assert plan.gemm_routes("o") == fallback.gemm_routes("o")
    assert plan.int8_gemm == fallback.int8_gemm
    assert (plan.weight_only_max_rows, plan.prefill) == (fallback.weight_only_max_rows, fallback.prefill)
    assert plan.source == "measured"


def test_forced_routes_override_and_bad_ones_name_the_choices():
    base = choose({"gemm": {"qkv": gemm_times(r16=(2.0, 1.0))}})
    forced = apply_overrides(base, parse_overrides("gemm=carpool, prefill=flash, weight_only_max_rows=0"))
    assert forced.gemm_routes("qkv") == ((UNBOUNDED, "carpool"),) and forced.prefill == ((UNBOUNDED, "flash"),)
    assert forced.weight_only_max_rows == 0 and forced.source == "measured+forced"
    assert apply_overrides(base, parse_overrides("prefill=kernel")).prefill == ((UNBOUNDED, "kernel"),)
    both = apply_overrides(base, parse_overrides("prefill=brgemm,decode=brgemm"))
    assert both.prefill == both.decode == ((UNBOUNDED, "brgemm"),)
    assert parse_overrides("default") == {"mode": "default"}
    for bad, words in [("gemm=amx", "carpool, carpool_split, onednn"), ("speed=11", "KEY=VALUE"),
                       ("weight_only_max_rows=x", "whole"), ("decode=flash", "kernel, brgemm")]:
        with pytest.raises(ValueError, match=words):
            parse_overrides(bad)


def test_plan_json_round_trip():
    plan = choose({"gemm": {"qkv": gemm_times(r16=(1.0, 2.0), r64=(2.0, 1.0))},
                   "prefill": [point(64, 0, 2, 1)],
                   "grain": {"light": [grain(64, 576, 1, 2)], "silu": [grain(64, 1536, 2, 1)]}})
    back = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert back == plan and back.timings == plan.timings
    assert (back.row_grain, back.silu_grain) == (64 * 576, 0)


def grain(rows, width, one, split):
    return {"rows": rows, "width": width, "one": one, "split": split}


def test_thread_grain_is_the_largest_pass_one_thread_still_won():
    """A machine where waking the second thread is dear keeps more rows on one thread than one
    where it is cheap; noise inside the margin keeps one thread."""
    dear_wake = [grain(8, 576, 1, 3), grain(64, 576, 5, 7), grain(256, 576, 20, 12), grain(1024, 576, 80, 41)]
    cheap_wake = [grain(8, 576, 1, 3), grain(64, 576, 5, 3), grain(256, 576, 20, 11), grain(1024, 576, 80, 41)]
    assert choose_grain(dear_wake) == 64 * 576
    assert choose_grain(cheap_wake) == 8 * 576
    assert choose_grain([grain(8, 576, 1.0, 0.99), grain(64, 576, 8, 4)]) == 8 * 576  # within MARGIN
    assert choose_grain([grain(8, 576, 2, 1), grain(64, 576, 8, 4)]) == 0  # splitting won everywhere
    plan = choose({"grain": {"light": dear_wake, "silu": cheap_wake}})
    assert (plan.row_grain, plan.silu_grain) == (64 * 576, 8 * 576)
    fallback = default_plan()
    untimed = choose({})
    assert (untimed.row_grain, untimed.silu_grain) == (fallback.row_grain, fallback.silu_grain)
    forced = apply_overrides(plan, parse_overrides("row_grain=0,silu_grain=1000000"))
    assert (forced.row_grain, forced.silu_grain) == (0, 1000000)
    with pytest.raises(ValueError, match="row_grain takes a whole number"):
        parse_overrides("row_grain=many")


# ----------------------------------------------------------------------------- the plan file


FP = {"format": 1, "cpu": "Some CPU", "cpu_flags": "aaaa", "torch": "2.13.0", "kernels": "k", "threads": 2,
      "model": {"hidden": 64}}


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "plan.json"
    plan = Plan(**{**choose({"gemm": {"o": gemm_times(r16=(2.0, 1.0))}}).__dict__, "fingerprint": FP})
    plan_cache.save(path, plan)
    return path, plan


def test_a_saved_plan_loads_on_the_same_machine(saved):
    path, plan = saved
    got = plan_cache.load(path, dict(FP))
    assert got is not None and got.gemm == plan.gemm and got.source == "cached"


@pytest.mark.parametrize("changed", [{"cpu_flags": "bbbb"}, {"torch": "2.14.0"}, {"cpu": "Other CPU"},
                                     {"model": {"hidden": 128}}], ids=["cpu-flags", "torch", "cpu", "model"])
def test_a_plan_from_another_machine_or_torch_is_ignored_with_a_warning(saved, caplog, changed):
    path, _ = saved
    with caplog.at_level(logging.WARNING):
        assert plan_cache.load(path, {**FP, **changed}) is None
    assert f"measured under another {next(iter(changed))}" in caplog.text


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"gemm": {"o": [[16, "amx"]]}}', ""],
                         ids=["garbage", "list", "bad-route", "empty"])
def test_a_corrupt_plan_file_is_ignored_with_a_warning(tmp_path, caplog, text):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING):
        assert plan_cache.load(path, FP) is None
    assert "is corrupt" in caplog.text


# ----------------------------------------------------------------------------- in the engine


def test_the_engine_measures_once_then_loads_and_remeasures_on_another_cpu(tiny, h, kernels, tmp_path,
                                                                             monkeypatch, caplog):
    """obtain() on the real (tiny bf16) model: measured and saved, then loaded from the file; a
    different CPU flag set or torch version in the fingerprint measures again."""
    from carpool.engine.model import LlamaModel

    _, loaded = tiny
    model = LlamaModel(loaded.config, loaded.state_dict, torch.bfloat16)
    k = Kernels(cache_dir=tmp_path)
    k.module, k.isa, k.has_bf16_gemm, k.has_int8_gemm = (kernels.module, kernels.isa, kernels.has_bf16_gemm,
                                                         kernels.has_int8_gemm)
    first = plan_measure.obtain(model, k, 64, 256, setting="measure")
    assert first.source == "measured" and first.timings["prefill"]
    if kernels.has_bf16_gemm:
        assert set(first.timings["gemm"]) == {"qkv", "o", "gate_up", "down", "head"}
    assert plan_measure.obtain(model, k, 64, 256, setting="measure").source == "cached"
    real = plan_cache.machine_fingerprint
    for change in ({"cpu_flags": "0000"}, {"torch": "0.0.0"}):
        monkeypatch.setattr(plan_cache, "machine_fingerprint", lambda c=change: {**real(), **c})
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert plan_measure.obtain(model, k, 64, 256, setting="measure").source == "measured"
        assert "measured under another" in caplog.text


def test_rows_are_cut_only_where_the_blocks_do_not_divide_between_the_threads(tiny, kernels):
    """The tiny model's linears have 2, 4 and 8 column blocks: on two threads each divides, so only
    the whole-block GEMM is timed; on three none does, so the cut one is timed too."""
    if not kernels.has_bf16_gemm:
        pytest.skip("this CPU has no AVX-512 BF16")
    from carpool.engine.model import LlamaModel

    _, loaded = tiny
    model = LlamaModel(loaded.config, loaded.state_dict, torch.bfloat16)
    threads = torch.get_num_threads()
    timed = {}
    try:
        for n in (2, 3):
            torch.set_num_threads(n)
            timed[n] = plan_measure.measure(model, kernels, 16, 64, budget_s=30)["gemm"]
    finally:
        torch.set_num_threads(threads)
    assert not any("carpool_split" in t for by_rows in timed[2].values() for t in by_rows.values())
    assert set(timed[3]) == {"qkv", "o", "gate_up", "down", "head"}
    for name, by_rows in timed[3].items():  # buckets of 4, 8 and 16 rows (the head: 4)
        assert by_rows and all("carpool_split" in t for t in by_rows.values()), name


def _generate(loaded, h, dtype: str, plan: str, ps: list[list[int]], n: int, **kw):
    cfg = h.engine_config(dtype=dtype, max_num_batched_tokens=32,
                          extra={"attention": "kernel", "plan": plan, **kw})
    llm = LLM(cfg, loaded=loaded)
    reqs = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                            params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for i, p in enumerate(ps)]
    return [o.token_ids for o in llm.generate(reqs)], llm


ROUTES = ["measure", "default", "gemm=carpool,prefill=kernel", "gemm=onednn,prefill=flash",
          "prefill=brgemm,decode=brgemm", "gemm=onednn,prefill=brgemm,decode=kernel",
          "gemm=onednn,prefill=kernel", "gemm=carpool,prefill=flash", "gemm=carpool_split,prefill=kernel",
          "row_grain=0,silu_grain=0",
          "row_grain=1099511627776,silu_grain=1099511627776"]


@pytest.mark.parametrize("plan", ROUTES)
def test_every_route_answers_as_transformers_fp32(tiny, h, plan):
    model, loaded = tiny
    ps = h.prompts(4, [3, 17, 40, 70])
    outs, _ = _generate(loaded, h, "float32", plan, ps, 10)
    for p, out in zip(ps, outs, strict=True):
        assert out == h.hf_greedy(model, p, 10)


@pytest.mark.parametrize("plan", ROUTES)
def test_every_bf16_route_answers_as_transformers(tiny, h, kernels, plan, monkeypatch):
    """bf16 weights (where the packed GEMM and oneDNN both run): greedy tokens equal HF's bf16
    model's, and a forced GEMM route really is the one that runs.  The split route runs on three
    threads, where none of the tiny model's block counts (2, 4, 8) divides evenly, so its rows are
    really cut."""
    model, loaded = tiny
    ref = copy.deepcopy(model).to(torch.bfloat16)  # the session's fp32 model stays as it is
    calls = []
    orig = Kernels.bf16_gemm

    def counted(self, x, *a, **kw):
        calls.append((x.shape[0], kw.get("split_rows", False)))
        return orig(self, x, *a, **kw)

    monkeypatch.setattr(Kernels, "bf16_gemm", counted)
    chunk_routes: list[int] = []  # the route of every chunk attention ran (0 flash, 1 brgemm)
    orig_attention = Kernels.attention

    def attention(self, *a):
        chunk_routes.extend(a[8][:, 4].tolist())
        return orig_attention(self, *a)

    monkeypatch.setattr(Kernels, "attention", attention)
    ps = h.prompts(4, [3, 17, 40, 70])
    threads = torch.get_num_threads()
    torch.set_num_threads(3 if "carpool_split" in plan else threads)
    try:
        outs, _ = _generate(loaded, h, "bfloat16", plan, ps, 10)
    finally:
        torch.set_num_threads(threads)
    assert outs == [h.hf_greedy(ref, p, 10) for p in ps]
    if "gemm=onednn" in plan:
        assert not calls
    if "gemm=carpool" in plan and kernels.has_bf16_gemm:
        assert calls and all(split == ("carpool_split" in plan) for _, split in calls)
    if "brgemm" in plan and kernels.brgemm_attention_runs(torch.bfloat16):  # the GEMM route really ran
        assert chunk_routes and set(chunk_routes) == {1}
    if "row_grain" in plan:  # the forced limits are the ones the kernels run with
        limit = dict(item.split("=") for item in plan.split(","))["row_grain"]
        assert kernels.row_grains() == (int(limit), int(limit))


@pytest.mark.parametrize("plan", ["gemm=carpool,prefill=kernel", "gemm=onednn,prefill=kernel"])
def test_a_weight_is_packed_only_for_the_route_the_plan_gives_it(tiny, h, kernels, plan):
    """oneDNN's blocked copy and decode_gemm's copy of a weight are made only where the plan
    sends rows to that GEMM (packing both cost part of every engine start)."""
    if not kernels.has_bf16_gemm:
        pytest.skip("no bf16 GEMM kernel on this CPU: oneDNN is the only route")
    _, loaded = tiny
    _, llm = _generate(loaded, h, "bfloat16", plan, h.prompts(2, [5, 30]), 4)
    model = llm.engine.model
    linears = [one for layer in model.linears for one in layer.values()] + [model.head_linear]
    onednn = {one._onednn is not None for one in linears}
    decode = {one._decode is not None for one in linears}
    assert (onednn, decode) == (({False}, {True}) if "carpool" in plan else ({True}, {False}))


@pytest.mark.parametrize("weight_only", [0, 4])
def test_int8_routes_answer_alike(tiny, h, kernels, weight_only, monkeypatch):
    """int8 weights: the packed int8 GEMM (whole blocks per thread or rows cut, on three threads
    where the tiny model's blocks do not divide), torch._int_mm and oneDNN's int8 linear give the
    same sums, so every int8 route answers the same greedy tokens, whichever weight-only limit the
    plan sets."""
    from carpool.engine.quant import Int8Linear

    _, loaded = tiny
    ps = h.prompts(5, [3, 9, 30, 3, 12, 7])
    ran = []
    orig = Int8Linear.qlinear_sums
    monkeypatch.setattr(Int8Linear, "qlinear_sums", lambda self, xq: ran.append(1) or orig(self, xq))
    carpool, onednn, qlinear = (_int8(loaded, h, f"int8_gemm={route},weight_only_max_rows={weight_only}", ps)
                                for route in ("carpool", "onednn", "onednn_qlinear"))
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        split = _int8(loaded, h, f"int8_gemm=carpool_split,weight_only_max_rows={weight_only}", ps)
    finally:
        torch.set_num_threads(threads)
    assert carpool == onednn == split == qlinear
    assert ran  # the oneDNN int8 linear really ran


def test_onednn_int8_linear_gives_int_mms_sums_and_values(kernels):
    """oneDNN's prepacked int8 linear (the "onednn_qlinear" route) writes float(int32 sums) exactly,
    so the scaled-back rows are torch._int_mm's bit for bit, at every row count, with sums past
    2^24 too (K 1536, full-range values)."""
    from carpool.engine.quant import Int8Linear, qlinear_available

    if not qlinear_available():
        pytest.skip("this torch has no oneDNN int8 linear")
    g = torch.Generator().manual_seed(0)
    w = Int8Linear(torch.randn(96, 1536, generator=g), torch.bfloat16)
    assert w.pack_qlinear()
    for rows in (1, 7, 64, 300):
        xq = torch.randint(-127, 128, (rows, 1536), dtype=torch.int8, generator=g)
        assert torch.equal(w.qlinear_sums(xq), w.int_mm(xq).float())
        xs = torch.rand(rows, generator=g) * 1e-2
        w.routes = ((UNBOUNDED, "onednn_qlinear"),)
        via_onednn = w.matmul(xq, xs, kernels)
        w.routes = ((UNBOUNDED, "onednn"),)
        assert torch.equal(via_onednn, w.matmul(xq, xs, kernels))


def _int8(loaded, h, plan, ps):
    cfg = h.engine_config(quantization="int8", max_num_batched_tokens=32, extra={"attention": "kernel", "plan": plan})
    llm = LLM(cfg, loaded=loaded)
    reqs = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                            params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            for i, p in enumerate(ps)]
    return [o.token_ids for o in llm.generate(reqs)]


def test_a_bad_plan_setting_is_refused_before_the_engine_starts(tiny, h):
    from carpool.errors import EngineError

    _, loaded = tiny
    with pytest.raises(EngineError, match=r"extra\.plan: .*prefill must be one of kernel, flash"):
        LLM(h.engine_config(extra={"plan": "prefill=sometimes"}), loaded=loaded)


def test_two_measuring_passes_keep_the_better_time_of_each():
    a = {"gemm": {"o": {"16": {"carpool": 1.0, "onednn": 2.0}}}, "prefill": [point(16, 0, 3.0, 1.0)]}
    b = {"gemm": {"o": {"16": {"carpool": 0.5, "onednn": 3.0}, "64": {"carpool": 1.0}}},
         "prefill": [point(16, 0, 2.0, 4.0)]}
    want = {"gemm": {"o": {"16": {"carpool": 0.5, "onednn": 2.0}, "64": {"carpool": 1.0}}},
            "prefill": [point(16, 0, 2.0, 1.0)]}
    assert plan_measure._best_of(a, b) == want


def test_carpool_engine_plan_refuses_a_bad_forced_route_with_exit_2(capsys):
    from carpool.cli import main

    assert main(["engine", "plan", "--model", "tiny-random", "--force", "gemm=amx"]) == 2
    err = capsys.readouterr().err
    assert "extra.plan" in err and "gemm must be one of carpool, carpool_split, onednn" in err


def test_carpool_engine_plan_and_prepare_refuse_a_model_name_that_is_not_one_in_one_line(capsys):
    """A mistyped --model was a traceback and exit 1 (the crash code), where `carpool run` says
    which model was meant."""
    from carpool.cli import main

    for action in ("plan", "prepare"):
        assert main(["engine", action, "--model", "smolm2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"carpool engine {action}: model='smolm2'") and "did you mean 'smollm2'?" in err
        assert "Traceback" not in err and err.count("\n") == 1


def test_carpool_engine_plan_prints_the_plan_and_its_timings(capsys):
    """The verb measures (or reads) the plan of this machine; a second call reads the saved one."""
    from carpool.cli import main

    args = ["engine", "plan", "--model", "tiny-random", "--dtype", "bfloat16", "--max-num-batched-tokens", "128"]
    assert main([*args, "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["timings"]["prefill"] and first["fingerprint"]["cpu"] == cpu.model_name()
    assert main(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("engine plan (cached)") and "prefill attention (" in text and "rows after" in text
    assert "decode attention (" in text and "step token budget: offline jobs" in text


def test_a_container_memory_limit_bounds_the_step_budget(tmp_path):
    """A pod limited to far less memory than its host sizes the step's activations for the
    limit (cgroup v2 or v1), not the host; "max" means no limit."""
    host = plan_measure.memory_bytes(())
    assert host is not None and host > 2**30
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")
    assert plan_measure.memory_bytes((str(v2),)) == host
    v1.write_text(f"{2**30}\n")
    assert plan_measure.memory_bytes((str(v2), str(v1))) == 2**30
    assert plan_measure.memory_bytes((str(tmp_path / "missing"),)) == host
