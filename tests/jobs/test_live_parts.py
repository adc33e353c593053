"""``RunOptions`` is the frozen result of the flags; what a job is given or settles at start
(an engine, a budget, the model identity) travels beside it as ``LiveParts``."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from carpool.client.models import ModelIdentity
from carpool.jobs.fingerprint import job_identity, make_fingerprint
from carpool.jobs.options import LiveParts, RunOptions
from carpool.jobs.python_api.arguments import make_job, make_options
from carpool.jobs.start.model import resolve_target


def test_options_cannot_be_changed_after_parsing():
    opts = RunOptions(input="in.jsonl", output="out.jsonl")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.output = "other.jsonl"  # type: ignore[misc]
    assert dataclasses.replace(opts, output="other.jsonl").output == "other.jsonl"
    assert {"engine", "budget", "identity", "embedder_factory"}.isdisjoint(f.name for f in dataclasses.fields(opts))


def test_the_api_splits_its_keywords_into_settings_and_live_parts():
    engine = object()
    opts, live = make_job("in.jsonl", "out.jsonl", engine=engine, concurrency=4, model="tiny-random")
    assert live.engine is engine and opts.concurrency == 4 and opts.engine_model == "tiny-random"
    with pytest.raises(TypeError, match="live parts"):
        make_options("in.jsonl", "out.jsonl", engine=engine)
    with pytest.raises(TypeError, match="unknown keyword argument 'engin'"):
        make_job("in.jsonl", "out.jsonl", engin=engine)


def test_the_identity_settled_at_start_is_a_live_part_the_fingerprint_uses():
    opts = RunOptions(input="", output="", echo=True)
    settled, live, notes = asyncio.run(resolve_target(opts))
    assert settled == opts and notes == []  # the options stay what they were told
    assert live.identity == ModelIdentity("echo", kind="echo")
    reported = LiveParts(identity=ModelIdentity("m-2024", kind="http"))
    assert job_identity(opts, reported).name == "m-2024"
    assert make_fingerprint(opts, reported)["model"] != make_fingerprint(opts)["model"]
    # Already settled: resolving again asks nothing and keeps it.
    assert asyncio.run(resolve_target(opts, live=reported))[1] is reported
