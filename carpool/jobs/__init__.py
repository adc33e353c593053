"""The batch job: a file (or records) of tasks in, one output line per task out, crash-safe.

- ``options``: ``RunOptions``; ``parts``: the parts a job is made of and the default ones;
  ``pipeline``: ``Pipeline`` runs them; ``runner``: ``Runner`` = default parts + pipeline +
  report; ``api``: ``run_batch`` / ``arun_batch``.
- ``readers`` and ``tasks``: input formats and per-line validation; ``journal`` and
  ``writer``: the output file is the journal (resume); ``task_cache``: answers reused
  from the caches (``caching``) or from an identical task in flight (``dedup``);
  ``task_slots``: the bound on tasks between reading and writing.
- ``progress``, ``summary``, ``report``: the progress line, the statistics, the HTML page.
"""
