"""The batch job: a file (or records) of tasks in, one output line per task out, crash-safe.

Every job goes through ``runner.Runner``, whoever starts it (``carpool run``, the Python
API, a Ray driver): its start (``start/``: the one start-up check, the endpoints' models),
the output's lock and prices, then its ``spread.Spread``, which runs the tasks:
``in_process.InProcess`` (the default: the ``parts`` a job is made of, run by the
``pipeline``), Ray's shards (``carpool.distributed``) or a provider's batch API
(``provider_batch/``).  ``options.RunOptions`` is all a job can be told.

Around it, one concern a package: ``input/`` (readers, per-line validation, prefix order),
``output/`` (the Parquet/CSV table, the output's lock, structured answers; the lines
themselves are the journal's, ``carpool.journal``), ``reuse/`` (caches, dedup), ``cost/``
(prices, tokens, ``--estimate``), ``summary/`` (statistics, progress, the HTML report, exit
codes), ``python_api/`` (``run_batch`` / ``arun_batch``); ``dry_run`` is ``--dry-run``.
"""
