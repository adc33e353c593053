"""The errors carpool raises at its edges, as one tree; the exit code of ``carpool run``
is read from where an error sits in it (``carpool.jobs.summary.exit_codes.code_for_error``).

::

    CarpoolError                      anything carpool raises on purpose
    ├── StartRefused                  exit 2: the job cannot start as asked (bad flags, an
    │   │                             unreadable input or price file, a bad --cache URL)
    │   ├── FingerprintMismatch       a resume that would mix answers made another way
    │   ├── OutputLocked              another run holds the output
    │   ├── EndpointsFileError        the --endpoints file cannot be used
    │   ├── PlanMismatch              a Ray work directory left by another input
    │   └── RayRunError               a --ray run asked for something it cannot do
    ├── ModelUnavailable              exit 2: the model named cannot be loaded; the user
    │   └── ModelLoadError            chose it and can fix it (an unknown name, a folder
    │                                 that holds no model), so a refused start
    └── EngineFailure                 exit 1: the engine refused work given to it after
        └── EngineError               the start; carpool should have turned it into a
            └── GrammarError          task's error line, so it is reported as a crash

Every class below the root is also a ``ValueError``, as each was before the tree
existed, so callers that catch ``ValueError`` keep working; the exit code is no longer
read from that, though: a plain ``ValueError`` escaping a job is a bug (exit 1).  Each
leaf is defined where it is raised; this module holds the roots, and imports nothing,
so that every layer can use them.
"""

from __future__ import annotations


class CarpoolError(Exception):
    """The root: an error carpool raises on purpose, with a message meant for the user."""


class StartRefused(CarpoolError, ValueError):
    """The job cannot start as asked (exit 2); the message says why and what to do."""


class ModelUnavailable(CarpoolError, ValueError):
    """The model named cannot be loaded (exit 2): a choice the user makes and can fix."""


class EngineFailure(CarpoolError, ValueError):
    """The engine refused work it was given (exit 1 if it escapes a job)."""
