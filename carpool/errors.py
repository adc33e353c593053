"""Every exception carpool defines, as one tree under ``CarpoolError``; the exit code of
``carpool run`` is read from where an error sits in it
(``carpool.jobs.summary.exit_codes.code_for_error``).

::

    CarpoolError                      anything carpool raises on purpose
    ├── StartRefused                  exit 2: the job cannot start as asked (bad flags, an
    │   │                             unreadable input or price file, a bad --cache URL)
    │   ├── FingerprintMismatch       a resume that would mix answers made another way
    │   ├── OutputLocked              another run holds the output
    │   ├── EndpointsFileError        the --endpoints file cannot be used
    │   ├── PlanMismatch              a Ray work directory left by another input
    │   ├── RayRunError               a --ray run asked for something it cannot do
    │   ├── MissingExtra              a feature whose pip extra is not installed (ImportError)
    │   ├── EngineSettingsError       settings the engine cannot start with (an EngineError too)
    │   ├── DatasetError              a bench / diagnose workload file or option
    │   ├── MetricsError              a bench metric option (--goodput, --metric-percentiles)
    │   ├── GpuFileError              a --gpu file that describes no accelerator
    │   ├── ModelConfigError          a --model-config file that is no model's shape
    │   ├── CaseError                 a file of published measurements
    │   └── TrafficFileError          a --traffic file that gives no day's traffic
    ├── ModelUnavailable              exit 2: the model named cannot be loaded; the user
    │   ├── ModelLoadError            chose it and can fix it (an unknown name, a folder
    │   ├── GGUFError                 that holds no model, a GGUF file carpool cannot
    │   └── EmbedderError             read, an embedding model that is not there)
    ├── EngineFailure                 exit 1: the engine refused work given to it after
    │   └── EngineError               the start; carpool should have turned it into a
    │       ├── GrammarError          task's error line, so it is reported as a crash
    │       └── EngineSettingsError
    ├── OutputError                   exit 5: the output could not be written (an OSError)
    ├── OpenAIError                   an error answer in OpenAI's shape: HTTP status + body
    │   └── EngineAborted             the engine aborted a choice (it is shutting down)
    ├── RequestFailed                 one request cannot be answered as asked: carpool
    │   ├── SchemaError               makes it that request's error (its error line, or an
    │   ├── EventTooLarge             HTTP error answer) and goes on with the others
    │   ├── QueueFullError
    │   ├── QueueTimeoutError
    │   ├── Untranslatable
    │   └── AzureRefusal
    ├── ServiceFailure                a service the job relies on refused or stayed away
    │   ├── BudgetUnavailable         (Redis, a provider's Batch API); exit 1 if it
    │   └── BatchApiError             escapes a job
    │       └── MaybeCreated
    └── InternalSignal                not an error: a stop carpool raises to unwind to its own
        ├── Stopped                   caller, which catches it; it never reaches a user
        ├── OutageTimeout
        ├── StepInterrupted
        ├── OutOfTime
        ├── JobTerminated
        ├── NotAnswered
        └── BudgetClosed

Each class keeps the Python base it had before the tree existed (the roots and most
leaves are ``ValueError``; ``MissingExtra`` an ``ImportError``, ``OutputError`` an
``OSError``, ``QueueTimeoutError`` a ``TimeoutError``, ...), so callers that catch those
keep working; the exit code is not read from them, though: a plain ``ValueError`` escaping
a job is a bug (exit 1).  This module imports nothing of carpool, so that every layer can
raise what it needs; the modules that raise an error import it from here.
"""

from __future__ import annotations


class CarpoolError(Exception):
    """The root: an error carpool raises on purpose, with a message meant for the user."""


# ----------------------------------------------------------------------------- the branches


class StartRefused(CarpoolError, ValueError):
    """The job cannot start as asked (exit 2); the message says why and what to do."""


class ModelUnavailable(CarpoolError, ValueError):
    """The model named cannot be loaded (exit 2): a choice the user makes and can fix."""


class EngineFailure(CarpoolError, ValueError):
    """The engine refused work it was given (exit 1 if it escapes a job)."""


class RequestFailed(CarpoolError):
    """One request cannot be answered as asked; its caller turns this into that request's
    error and goes on with the others."""


class ServiceFailure(CarpoolError):
    """A service the job relies on (Redis, a provider's Batch API) refused a call for good or
    stayed unreachable."""


class InternalSignal(CarpoolError):
    """Not an error: raised to unwind to a caller inside carpool that catches it (a stop, an
    interrupted step, a spent time budget).  It never reaches a user; one that does is a bug."""


# ----------------------------------------------------------------------------- refused starts


class FingerprintMismatch(StartRefused):
    """A resume that would mix answers made another way into the output (exit 2)."""


class OutputLocked(StartRefused):
    """Another run holds the output file (exit 2); the message names it and what to do."""


class EndpointsFileError(StartRefused):
    """The endpoints file cannot be used (exit 2); the message names the entry and the field."""


class PlanMismatch(StartRefused):
    """The work directory belongs to a different input file."""


class RayRunError(StartRefused):
    """A ``--ray`` run asked for something it cannot do (exit 2)."""


class MissingExtra(ImportError, StartRefused):
    """A feature was asked for whose extra is not installed; the message says how to add it.
    ``ImportError`` comes first so that its ``__init__`` still sets ``msg``."""

    def __init__(self, extra: str, feature: str, missing: list[str]) -> None:
        self.extra, self.feature, self.missing = extra, feature, missing
        super().__init__(f"{feature} needs carpool's {extra!r} extra ({', '.join(missing)} not installed): "
                         f"pip install 'carpool[{extra}]'")


class DatasetError(StartRefused):
    """A dataset file or option that cannot be used; the message says where and what to do."""


class MetricsError(StartRefused):
    """A metric option that cannot be parsed; the message says which and how to write it."""


class GpuFileError(StartRefused):
    """A --gpu file that does not describe an accelerator."""


class ModelConfigError(StartRefused):
    """A --model-config file that cannot be read as a model's shape."""


class CaseError(StartRefused):
    """A case file that does not describe a published measurement."""


class TrafficFileError(StartRefused):
    """A --traffic file that does not give a day's traffic."""


# ----------------------------------------------------------------------------- models that cannot load


class ModelLoadError(ModelUnavailable):
    """A model carpool cannot load; the message says what is wrong and what to do."""


class GGUFError(ModelUnavailable):
    """A GGUF file carpool cannot use; the message says which field and why."""


class EmbedderError(ModelUnavailable):
    """An embedding model carpool cannot load, or bad input; the message says why."""


# ----------------------------------------------------------------------------- the engine


class EngineError(EngineFailure):
    """A request the engine cannot run (prompt past the context, bad parameter).

    The message says which field and why; the server maps it to a 400.
    """


class EngineSettingsError(EngineError, StartRefused):
    """The engine cannot start with the settings it was given (dtype, quantization, max_model_len,
    ``extra.*``, a forced plan): the user's to fix, so a refused start (exit 2), not a crash."""


class KernelsDoNotFitModel(EngineSettingsError):
    """The engine was told to run on the C++ kernels (``extra.attention=kernel``), and they are
    not compiled for the model's head size: such a model runs on the torch path only."""

    def __init__(self, message: str, head_dim: int) -> None:
        super().__init__(message)
        self.head_dim = head_dim


class GrammarError(EngineError):
    """A grammar refused when compiled or at its first tokens.

    ``field`` is the ``StructuredOutputs`` field that holds it ("json", "choice", ...) and
    ``reason`` says what is wrong in words, with no llguidance state or backtrace, so a
    server can put both in a 400 under the body's own field name."""

    def __init__(self, field: str, reason: str, rid: str = "") -> None:
        where = f"request {rid}: " if rid else ""
        super().__init__(f"{where}structured_outputs.{field}: {reason}")
        self.field = field
        self.reason = reason


# ----------------------------------------------------------------------------- the output


class OutputError(CarpoolError, OSError):
    """The output could not be written; the message says which file, why, and how to resume."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


# ----------------------------------------------------------------------------- OpenAI error answers

# HTTP status -> the OpenAI error "type" clients switch on.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}

# An error echoes what it refuses (a model name, a field path, a value): a 1 MB "model" must
# not come back as a 1 MB error body, nor go whole into a log.
MAX_MESSAGE_CHARS = 2000
MAX_PARAM_CHARS = 200


def bounded(text: str, most: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``most`` characters, saying how much was left out."""
    if len(text) <= most:
        return text
    return f"{text[: most - 40]}... ({len(text) - most + 40:,} more characters)"


class OpenAIError(CarpoolError):
    """An error answer: ``status`` for HTTP, ``body()`` for the JSON, ``headers`` (e.g. Retry-After).

    The translation layer raises one for a body it cannot run (a field out of range, a prompt
    past the context), the server's handlers for everything else (unknown model, full queue).
    The server turns one into a response; the in-process backend into a failed result with
    the same body, so a task fails the same way with and without ``--endpoint``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": bounded(self.message), "type": self.type,
                          "param": bounded(self.param, MAX_PARAM_CHARS) if self.param is not None else None,
                          "code": self.code}}


class EngineAborted(OpenAIError):
    """The engine aborted a choice (it is shutting down): no answer, retry elsewhere or later.
    Apart from the other 503s so a caller can tell "not run to its end" from "failed"."""


# ----------------------------------------------------------------------------- one request


class SchemaError(RequestFailed, ValueError):
    """A body that does not match its schema.

    ``param`` is the dotted path of the culprit (``messages[0].role``), ``reason`` what is
    wrong with it, ``message`` both together.
    """

    def __init__(self, param: str, reason: str) -> None:
        self.param = param
        self.reason = reason
        self.message = f"'{param}': {reason}"
        super().__init__(self.message)


class EventTooLarge(RequestFailed, ValueError):
    """A server-sent event past the reader's bound: a runaway stream, not read further."""


class QueueFullError(RequestFailed, RuntimeError):
    """The queue is at max_queue_size; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueTimeoutError(RequestFailed, TimeoutError):
    """The request waited in the queue longer than queue_timeout_s and was dropped."""


class Untranslatable(RequestFailed, ValueError):
    """A chat body with no Anthropic form; ``field`` names the body field at fault."""

    def __init__(self, field: str, reason: str):
        super().__init__(reason)
        self.field = field


class AzureRefusal(RequestFailed):
    """What the fake Azure resource answers instead of doing as asked: an HTTP status and
    Azure's error code."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


# ----------------------------------------------------------------------------- services


class BudgetUnavailable(ServiceFailure, RuntimeError):
    """The shared RPM/TPM budget in Redis stayed unreachable past its timeout."""


class BatchApiError(ServiceFailure, RuntimeError):
    """The provider refused a call for good (4xx other than 429) or never answered it."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class EndpointLost(ServiceFailure, RuntimeError):
    """A measurement could not reach its endpoint at all (every request of a probe failed to
    connect): what it would report is the outage, not the server's speed."""


class MaybeCreated(BatchApiError):
    """A create whose fate is unknown: the batch may exist; look it up before creating again."""


# ----------------------------------------------------------------------------- internal signals


class Stopped(InternalSignal):
    """The job is stopping: this request was not sent (it runs again on resume)."""


class OutageTimeout(InternalSignal):
    """Every endpoint has been down for longer than the outage timeout: the job stops
    (exit code 4) and this request, not sent, runs again on resume."""


class StepInterrupted(InternalSignal):
    """A step stopped between two layers because ``meta.interrupt`` was set.  Nothing it
    computed is used: the caller leaves its sequences as they were, and the keys and values
    it already wrote are written again, to the same slots and with the same values, when the
    step is run again."""


class OutOfTime(InternalSignal):
    """The search's time budget is spent: the answer is the best rate probed so far."""


class JobTerminated(InternalSignal):
    """The job was cancelled by SIGTERM: ``run_batch`` unwinds to where it ends the process
    by that signal."""


class NotAnswered(InternalSignal):
    """The engine aborted the request (shutting down): no answer to record."""


class BudgetClosed(InternalSignal, RuntimeError):
    """The shared budget was closed while a request waited for it."""
