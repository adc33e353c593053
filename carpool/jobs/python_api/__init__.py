"""The Python API: ``carpool.run_batch`` and ``carpool.arun_batch`` (``run``).

``arguments``: their keyword arguments as a job's ``RunOptions`` and ``LiveParts``;
``in_memory``: tasks given as a list, a DataFrame or a Dataset, and results given back as
the same kind; ``warm``: the in-process engines kept warm between calls.
"""
