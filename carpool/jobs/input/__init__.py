"""A job's tasks as they come in: read from a file, checked line by line, put in order.

``readers``: the streamed readers (JSONL plain or OpenAI Batch, CSV, Parquet) and records
already in memory, each a ``TaskSource``; ``tasks``: one record to a ``Task`` (an OpenAI
request body) or a ``BadLine`` saying which field is wrong; ``prefix_order``: tasks that
share a long prompt prefix sent together (``--prefix-order``).
"""
