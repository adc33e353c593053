"""carpool's error tree decides the exit code of a job that ended early, not ``ValueError``."""

from __future__ import annotations

import argparse

import pytest

from carpool.errors import (
    AzureRefusal,
    BatchApiError,
    BudgetClosed,
    BudgetUnavailable,
    CarpoolError,
    CaseError,
    DatasetError,
    EmbedderError,
    EndpointsFileError,
    EngineAborted,
    EngineError,
    EngineFailure,
    EngineSettingsError,
    EventTooLarge,
    FingerprintMismatch,
    GGUFError,
    GpuFileError,
    GrammarError,
    JobTerminated,
    MaybeCreated,
    MetricsError,
    MissingExtra,
    ModelConfigError,
    ModelLoadError,
    ModelUnavailable,
    NotAnswered,
    OpenAIError,
    OutageTimeout,
    OutOfTime,
    OutputError,
    OutputLocked,
    PlanMismatch,
    QueueFullError,
    QueueTimeoutError,
    RayRunError,
    SchemaError,
    StartRefused,
    StepInterrupted,
    Stopped,
    TrafficFileError,
    Untranslatable,
)
from carpool.jobs.summary.exit_codes import ExitCode, code_for_error


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
    # A missing extra refuses the start, as `carpool run` (and every verb) always answered it.
    (MissingExtra("engine", "carpool's inference engine", ["torch"]), ExitCode.REFUSED),
    # The files and options of bench, diagnose and tune are inputs the user fixes.
    (DatasetError("w.jsonl:3: not valid JSON"), ExitCode.REFUSED),
    (MetricsError("--goodput ttft: write KEY:MILLISECONDS"), ExitCode.REFUSED),
    (GpuFileError("no memory"), ExitCode.REFUSED),
    (ModelConfigError("no hidden_size"), ExitCode.REFUSED),
    (CaseError("no points"), ExitCode.REFUSED),
    (TrafficFileError("no hours"), ExitCode.REFUSED),
    # A GGUF file or an embedding model that cannot be read is a model that cannot load.
    (GGUFError("m.gguf: not a readable GGUF file"), ExitCode.REFUSED),
    (EmbedderError("embedding model 'x': not a folder"), ExitCode.REFUSED),
    # What carpool turns into one request's error, a service gone, and its own stop signals are
    # crashes when they escape a job: carpool should have caught them.
    (OpenAIError(400, "bad body"), ExitCode.CRASHED),
    (EngineAborted(503, "aborted"), ExitCode.CRASHED),
    (SchemaError("messages[0].role", "not a role"), ExitCode.CRASHED),
    (EventTooLarge("a stream event is over 64 bytes"), ExitCode.CRASHED),
    (QueueFullError("full", 1.0), ExitCode.CRASHED),
    (QueueTimeoutError("waited too long"), ExitCode.CRASHED),  # a TimeoutError, yet no output failure
    (Untranslatable("tools", "no Anthropic form"), ExitCode.CRASHED),
    (AzureRefusal(404, "404", "Resource not found"), ExitCode.CRASHED),
    (BudgetUnavailable("Redis unreachable"), ExitCode.CRASHED),
    (BatchApiError("refused", 400), ExitCode.CRASHED),
    (MaybeCreated("no answer"), ExitCode.CRASHED),
    (Stopped("r1"), ExitCode.CRASHED),
    (OutageTimeout("down"), ExitCode.CRASHED),
    (StepInterrupted(), ExitCode.CRASHED),
    (OutOfTime(), ExitCode.CRASHED),
    (JobTerminated(), ExitCode.CRASHED),
    (NotAnswered("aborted"), ExitCode.CRASHED),
    (BudgetClosed("closed"), ExitCode.CRASHED),
])
def test_the_exit_code_is_read_from_the_error_tree(error, code):
    assert code_for_error(error) == code


def test_every_class_of_the_tree_stays_a_value_error_for_callers_that_catch_one():
    for cls in (StartRefused, ModelUnavailable, EngineFailure, ModelLoadError, EngineError, PlanMismatch,
                RayRunError, FingerprintMismatch, OutputLocked, EndpointsFileError):
        assert issubclass(cls, CarpoolError) and issubclass(cls, ValueError), cls


@pytest.mark.parametrize(("cls", "base"), [
    (MissingExtra, ImportError), (DatasetError, ValueError), (MetricsError, ValueError), (GGUFError, ValueError),
    (EmbedderError, ValueError), (SchemaError, ValueError), (EventTooLarge, ValueError),
    (Untranslatable, ValueError), (QueueFullError, RuntimeError), (QueueTimeoutError, TimeoutError),
    (BudgetUnavailable, RuntimeError), (BudgetClosed, RuntimeError), (BatchApiError, RuntimeError),
    (OutputError, OSError),
])
def test_a_class_under_the_root_keeps_the_python_base_its_callers_catch(cls, base):
    assert issubclass(cls, CarpoolError) and issubclass(cls, base)


def test_a_missing_extra_is_still_an_import_error_with_its_fields():
    e = MissingExtra("parquet", "-o out.parquet", ["pyarrow"])
    assert (e.extra, e.feature, e.missing) == ("parquet", "-o out.parquet", ["pyarrow"])
    assert e.msg == str(e) == ("-o out.parquet needs carpool's 'parquet' extra (pyarrow not installed): "
                               "pip install 'carpool[parquet]'")


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


def test_a_gguf_file_that_cannot_be_read_refuses_the_start_as_a_model_that_cannot_load(monkeypatch, tmp_path, capsys):
    """The docs' table: a --model that cannot be loaded is exit 2 with one line saying why, not a
    crash asking for a bug report, whichever reader found it (here the GGUF one)."""
    from carpool.commands import run as run_command

    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path / "cache"))  # the failed conversion's lock file
    model = tmp_path / "broken.gguf"
    model.write_bytes(b"not a GGUF file at all")
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "prompt": "hi", "max_tokens": 2}\n')
    parser = argparse.ArgumentParser()
    run_command.add_arguments(parser)
    code = run_command.main(parser.parse_args([str(src), "-o", str(tmp_path / "o.jsonl"), "--model", str(model)]))
    err = capsys.readouterr().err
    assert code == ExitCode.REFUSED
    assert f"{model}: not a readable GGUF file" in err and "Traceback" not in err and "crashed" not in err


# ----------------------------------------------------------------------------- one module, one root

def _defined_exception_classes() -> list[tuple[str, str, type | None]]:
    """(module, qualified name, the class or None when it cannot be reached by import) of every
    exception class carpool defines, at any depth: the modules are imported and walked for
    what they hold, and read with ``ast`` for classes made inside a function."""
    import ast
    import importlib
    from pathlib import Path

    import carpool

    root = Path(carpool.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        module = importlib.import_module(name)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            cls = getattr(module, node.name, None)
            if isinstance(cls, type) and cls.__module__ == name and cls.__qualname__ == node.name:
                if issubclass(cls, BaseException):
                    found.append((name, node.name, cls))
            elif any(ast.unparse(b).rsplit(".", 1)[-1].endswith(("Error", "Exception", "Refused", "Unavailable",
                                                                   "Failure", "Signal", "Failed"))
                     for b in node.bases):
                found.append((name, node.name, None))  # made inside a function: read, not imported
    return found


def test_every_exception_class_carpool_defines_is_in_the_errors_module_under_the_root():
    found = _defined_exception_classes()
    assert any(name == "CarpoolError" for _, name, _ in found)  # the walk sees the tree itself
    elsewhere = [f"{module}.{name}" for module, name, _ in found if module != "carpool.errors"]
    assert elsewhere == [], "define these in carpool/errors.py, under CarpoolError"
    outside = [name for _, name, cls in found if cls is None or not issubclass(cls, CarpoolError)]
    assert outside == [], "these do not derive from CarpoolError"
