"""carpool's error tree decides the exit code of a job that ended early, not ``ValueError``."""

from __future__ import annotations

import argparse

import pytest

from carpool.distributed.ray_runner import RayRunError
from carpool.distributed.shards import PlanMismatch
from carpool.engine.loader import ModelLoadError
from carpool.engine.protocol import EngineError, EngineSettingsError, GrammarError
from carpool.errors import CarpoolError, EngineFailure, ModelUnavailable, StartRefused
from carpool.jobs.endpoints_file import EndpointsFileError
from carpool.jobs.output.lock import OutputLocked
from carpool.jobs.pipeline import OutputError
from carpool.jobs.summary.exit_codes import ExitCode, code_for_error
from carpool.journal.journal import FingerprintMismatch


@pytest.mark.parametrize(("error", "code"), [
    (StartRefused("bad flag"), ExitCode.REFUSED),
    (FingerprintMismatch("other model"), ExitCode.REFUSED),
    (OutputLocked("held"), ExitCode.REFUSED),
    (EndpointsFileError("entry 2"), ExitCode.REFUSED),
    (PlanMismatch("other input"), ExitCode.REFUSED),
    (RayRunError("no room"), ExitCode.REFUSED),
    (FileNotFoundError("no input"), ExitCode.REFUSED),
    (ModelLoadError("model='x': not a model"), ExitCode.REFUSED),
    (OutputError("disk full"), ExitCode.OUTPUT_FAILED),
    (PermissionError("read-only"), ExitCode.OUTPUT_FAILED),
    # An engine error escaping a job is carpool's failure to turn it into an error line.
    (EngineError("max_model_len"), ExitCode.CRASHED),
    (GrammarError("json", "bad schema"), ExitCode.CRASHED),
    # ... but settings the engine cannot start with are the user's to fix.
    (EngineSettingsError("extra.attention must be auto, kernel or torch"), ExitCode.REFUSED),
    # A plain ValueError is no refusal any more: the tree says what is one.
    (ValueError("a bug"), ExitCode.CRASHED),
    (KeyError("a bug"), ExitCode.CRASHED),
])
def test_the_exit_code_is_read_from_the_error_tree(error, code):
    assert code_for_error(error) == code


def test_every_class_of_the_tree_stays_a_value_error_for_callers_that_catch_one():
    for cls in (StartRefused, ModelUnavailable, EngineFailure, ModelLoadError, EngineError, PlanMismatch,
                RayRunError, FingerprintMismatch, OutputLocked, EndpointsFileError):
        assert issubclass(cls, CarpoolError) and issubclass(cls, ValueError), cls


def _run_main(monkeypatch, tmp_path, error: Exception) -> int:
    """``carpool run``'s exit code when its job raises ``error``."""
    from carpool.commands import run as run_command
    from carpool.jobs.runner import Runner

    src = tmp_path / "t.jsonl"
    src.write_text('{"prompt": "a"}\n')

    async def fail(self):
        raise error

    monkeypatch.setattr(Runner, "run", fail)
    parser = argparse.ArgumentParser()
    run_command.add_arguments(parser)
    return run_command.main(parser.parse_args([str(src), "-o", str(tmp_path / "o.jsonl"), "--echo-backend",
                                               "--quiet"]))


def test_carpool_run_reports_an_engine_error_as_a_crash_not_a_refused_start(monkeypatch, tmp_path, capsys):
    assert _run_main(monkeypatch, tmp_path, EngineError("request r1: the prompt is empty")) == ExitCode.CRASHED
    err = capsys.readouterr().err
    assert "crashed" in err and "EngineError" in err and "start" not in err.splitlines()[-1]


def test_carpool_run_still_refuses_a_model_that_cannot_load_and_a_bad_setting(monkeypatch, tmp_path, capsys):
    assert _run_main(monkeypatch, tmp_path, ModelLoadError("model='x': not a model")) == ExitCode.REFUSED
    assert capsys.readouterr().err.strip() == "carpool run: model='x': not a model"
    assert _run_main(monkeypatch, tmp_path, StartRefused("--prices p.json: not valid JSON")) == ExitCode.REFUSED


def test_a_bad_engine_setting_refuses_the_start_with_exit_2(monkeypatch, tmp_path, capsys):
    """A forced engine route that does not exist, through the real in-process engine start."""
    from carpool.commands import run as run_command

    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "prompt": "hi", "max_tokens": 2}\n')
    monkeypatch.setenv("CARPOOL_ENGINE_PLAN", "gemm=amx")
    parser = argparse.ArgumentParser()
    run_command.add_arguments(parser)
    code = run_command.main(parser.parse_args([str(src), "-o", str(tmp_path / "o.jsonl"), "--model", "tiny-random"]))
    err = capsys.readouterr().err
    assert code == ExitCode.REFUSED
    assert "CARPOOL_ENGINE_PLAN" in err and "carpool, carpool_split, onednn" in err and "Traceback" not in err
