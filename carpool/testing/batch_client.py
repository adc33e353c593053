"""Driving the Batch API of a server through the openai SDK, as its tests do: a request line,
an upload, a batch started, waited for, and its output read back."""

from __future__ import annotations

import io
import json
import time

FINAL = ("completed", "failed", "cancelled", "expired")


def request_line(i: int, max_tokens: int = 3, **over) -> dict:
    line = {"custom_id": f"task-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny-random", "messages": [{"role": "user", "content": f"Say {i}"}],
                     "max_tokens": max_tokens}}
    line.update(over)
    return line


def upload(client, lines: list, name: str = "in.jsonl"):
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return client.files.create(file=(name, io.BytesIO(text.encode())), purpose="batch")


def start_batch(client, lines: list):
    return client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                 completion_window="24h")


def wait_until(client, batch_id: str, until, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.monotonic() < deadline, f"batch still {b.status} ({b.request_counts}, {b.errors})"
        time.sleep(0.05)


def wait_final(client, batch_id: str, timeout_s: float = 240):
    return wait_until(client, batch_id, lambda b: b.status in FINAL, timeout_s)


def output_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.decode("utf-8").splitlines()]
