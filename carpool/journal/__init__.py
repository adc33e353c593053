"""The journal: a job's output file is its record of what is done, and survives any crash.

``writer`` writes output lines (the OpenAI Batch output shape) and appends them, flushed
and fsync'd in batches; ``done`` keeps the ids done so far in bounded memory; ``recovery``
reads a journal back after a crash (the half-written last line cut, each id's final
line) and compacts it; ``journal.Journal`` is one job's output files and the state file
beside them (the input, the command and the run fingerprint a resume is checked against).
Batch jobs (``carpool.jobs``) and the server's Batch API (``carpool.server``) both write
their results through it.
"""
