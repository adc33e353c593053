"""The exit codes of ``carpool run``: what a script calling it can rely on (docs/run.md).

One table for every verb, so a script can tell what happened from the code alone:

====  =====================================================================================
0     every task succeeded (tasks skipped on resume count when their line is a success line)
1     carpool itself crashed (an uncaught exception: please report it), or a worker of a
      ``--ray`` run did (the same command resumes its shards)
2     the start was refused: bad flags, an unreadable input, a fingerprint mismatch on
      resume, an unknown ``--model`` or one that cannot be loaded, an endpoints file that
      cannot be used
3     the job ran to its end but some tasks failed (their error lines are written)
4     stopped by an outage (the endpoints stayed down past ``--outage-timeout``; a rerun
      resumes the unfinished tasks)
5     the output could not be written (disk full, a read-only place); resume after fixing it
130   interrupted (SIGINT or SIGTERM); the same command resumes
====  =====================================================================================

A job that ran gets its code from its ``JobStats`` (``exit_code``); one that ended early
from where its error sits in carpool's error tree (``code_for_error``, ``carpool.errors``),
never from a Python base class such as ``ValueError``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

from carpool.errors import CarpoolError, ModelUnavailable, OutputError, StartRefused

if TYPE_CHECKING:
    from carpool.jobs.summary.stats import JobStats


class ExitCode(IntEnum):
    OK = 0
    CRASHED = 1
    REFUSED = 2
    TASKS_FAILED = 3
    OUTAGE = 4
    OUTPUT_FAILED = 5
    INTERRUPTED = 130


def exit_code(stats: JobStats) -> ExitCode:
    """The code of a job that ran (a refused start or a write failure never gets here)."""
    if stats.stopped_by_outage:
        return ExitCode.OUTAGE
    if stats.unfinished:  # a worker crashed: its tasks did not run
        return ExitCode.CRASHED
    if stats.interrupted:
        return ExitCode.INTERRUPTED
    if stats.n_errors or stats.failed_before:
        return ExitCode.TASKS_FAILED
    return ExitCode.OK


def code_for_error(error: BaseException) -> ExitCode:
    """The code of a job that ended in ``error`` before it could finish, read from where the
    error sits in carpool's error tree (``carpool.errors``), not from its Python base class:
    a refused start and a model that cannot load are the user's to fix (2), an output that
    cannot be written is 5, anything else, an engine failure included, is a crash (1)."""
    if isinstance(error, (StartRefused, ModelUnavailable, FileNotFoundError)):
        return ExitCode.REFUSED
    # Of carpool's own errors only OutputError says the output failed: a queue's
    # TimeoutError is an OSError too, and no disk is at fault.
    if isinstance(error, OutputError) or (isinstance(error, OSError) and not isinstance(error, CarpoolError)):
        return ExitCode.OUTPUT_FAILED
    return ExitCode.CRASHED
