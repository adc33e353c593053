"""Ids repeated across shards get the single-process treatment, under names no user gave."""

from __future__ import annotations

import json

from carpool.distributed.shards import Shard
from carpool.distributed.worker import ShardReader, fix_cross_shard_duplicates


def _task(cid: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": cid}]}}


def _answer(cid: str) -> str:
    return json.dumps({"custom_id": cid, "response": {"status_code": 200, "body": {}}, "error": None}) + "\n"


def test_a_made_up_name_never_equals_an_id_of_another_shard(tmp_path):
    # Line 3 repeats "a" (shard 2), and shard 2 also holds a task a user named "a#line-3".
    ids = ["a", "b", "a", "a#line-3"]
    src = tmp_path / "in.jsonl"
    lines = [(json.dumps(_task(c)) + "\n").encode() for c in ids]
    src.write_bytes(b"".join(lines))
    cut = len(lines[0]) + len(lines[1])
    shards = [Shard(0, 0, cut, 1, 2), Shard(1, cut, cut + len(lines[2]) + len(lines[3]), 3, 2)]
    parts = []
    for s in shards:  # each shard's runner answered its own lines (ids are unique inside a shard)
        out = tmp_path / f"out{s.index}.jsonl"
        reader = ShardReader(src, s)
        out.write_text("".join(_answer(item.custom_id) for item in reader))
        parts.append((out, None, tmp_path / f"done{s.index}"))
    assert fix_cross_shard_duplicates(shards, parts, lambda sh: ShardReader(src, sh)) == 1
    merged = [json.loads(line) for out, _, _ in parts for line in out.read_text().splitlines()]
    names = [d["custom_id"] for d in merged]
    assert len(names) == len(set(names)) == 4
    assert "a#line-3" in names and "a#line-3#2" in names
    renamed = next(d for d in merged if d["custom_id"] == "a#line-3#2")
    assert renamed["error"] is not None and "duplicate custom_id 'a'" in renamed["error"]["message"]
