"""carpool inside an existing Ray Data pipeline: ``ds = carpool_map(ds, endpoints=[...])``.

``carpool run --ray`` is for files.  When the tasks already are a Ray Dataset (read from
a warehouse, joined, filtered), ``carpool_map`` adds three columns to every row, the same
fields a carpool output line has:

- ``custom_id``: the row's own, else ``row-<k>`` (its index within its batch: give rows
  a custom_id column when you need stable ids);
- ``response``: the response body as JSON text (OpenAI shape), or None;
- ``error``: ``{"code", "message", "field"?}`` as JSON text, or None.

Each row is a task record (``messages`` | ``prompt`` | ``input`` plus parameters), or any
columns when ``template="Classify: {review}"`` builds the prompt.  Every actor runs the
batch runner's whole pipeline on its batches (adaptive concurrency, retries, cache,
dedup), with one event loop, and with the embedded engine one engine, for all of them.
Resume is Ray Data's business here (there is no output file to journal into).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from carpool.extras import require

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _plain(v: Any) -> Any:
    """numpy / pyarrow values from a Ray batch as plain JSON-able Python values."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _drop_nulls(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _drop_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_drop_nulls(x) for x in v]
    return v


def _rows(batch: Any) -> list[dict]:
    if hasattr(batch, "to_pylist"):  # pyarrow.Table
        return batch.to_pylist()
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas.DataFrame
        return [_plain(r) for r in batch.to_dict("records")]
    cols = list(batch)
    n = len(batch[cols[0]]) if cols else 0
    return [{c: _plain(batch[c][i]) for c in cols} for i in range(n)]


class CarpoolMapper:
    """A ``map_batches`` callable class; ``options`` are ``RunOptions`` fields."""

    def __init__(self, template: str | None = None, system: str | None = None, kind: str = "chat",
                 id_column: str | None = None, **options: Any):
        from carpool.jobs.input.tasks import Template
        from carpool.jobs.options import LIVE_NAMES, LiveParts, RunOptions

        self.template = Template(template, system=system, id_column=id_column, kind=kind) if template else None
        self.id_column = id_column
        self.live = LiveParts(**{k: options.pop(k) for k in LIVE_NAMES if k in options})
        self.opts = RunOptions(input="", output="", **options)
        self.loop = asyncio.new_event_loop()
        self.engine = None
        self.tmp = Path(tempfile.mkdtemp(prefix="carpool-ray-data-"))
        self.batches = 0

    def _engine(self):
        if self.engine is None:
            from carpool.distributed.worker import start_embedded_engine

            self.engine = start_embedded_engine(self.opts, self.loop)
        return self.engine

    def _record(self, row: dict, k: int) -> dict | str:
        if self.template is not None:
            rec = self.template.record(row, k)
            if not isinstance(rec, dict):  # a BadLine: keep its message for the error column
                return rec.message
        else:
            # Arrow fills a column missing from some rows with nulls: drop them, or they
            # would be sent as explicit nulls ("max_tokens": null).
            rec = _drop_nulls(row)
        cid = rec.get("custom_id") or row.get(self.id_column or "custom_id")
        rec["custom_id"] = str(cid) if cid not in (None, "") else f"row-{k}"
        return rec

    def __call__(self, batch: Any) -> dict:
        from carpool.jobs.input.readers import RecordSource
        from carpool.jobs.parts import build_parts, job_defaults
        from carpool.jobs.pipeline import Pipeline

        rows = _rows(batch)
        self.batches += 1
        dst = self.tmp / f"out-{self.batches}.jsonl"  # the pipeline's journal: one batch, then deleted
        ids: list[str] = []
        early: dict[int, str] = {}
        records: list[tuple[int, dict]] = []
        for k, row in enumerate(rows, 1):
            rec = self._record(row, k)
            if isinstance(rec, str):
                early[k - 1] = _dumps({"code": "invalid_input", "message": rec})
                ids.append(f"row-{k}")
                continue
            ids.append(rec["custom_id"])
            records.append((k, rec))
        opts = dataclasses.replace(self.opts, output=str(dst), progress=False, quiet=True, fresh=True, ordered=True)
        live = dataclasses.replace(self.live, engine=self._engine())
        source = RecordSource(records, job_defaults(opts))

        async def run() -> None:
            await Pipeline(build_parts(opts, live, source=source), opts).run()

        self.loop.run_until_complete(run())
        by_id: dict[str, list[dict]] = {}
        for line in dst.read_text().splitlines():
            doc = json.loads(line)
            by_id.setdefault(doc["custom_id"], []).append(doc)
        responses: list[str | None] = []
        errors: list[str | None] = []
        for i, cid in enumerate(ids):
            if i in early:
                responses.append(None)
                errors.append(early[i])
                continue
            docs = by_id.get(cid) or []
            doc = docs.pop(0) if docs else {"error": {"code": "missing", "message": "no result was written"}}
            body = (doc.get("response") or {}).get("body") if not doc.get("error") else None
            responses.append(_dumps(body) if body is not None else None)
            errors.append(_dumps(doc["error"]) if doc.get("error") else None)
        dst.unlink(missing_ok=True)
        Path(f"{dst}.carpool.json").unlink(missing_ok=True)
        out: dict[str, list[Any]] = {c: [r.get(c) for r in rows] for c in (rows[0] if rows else {})}
        out.update(custom_id=ids, response=responses, error=errors)
        return out

    def __del__(self) -> None:
        shutil.rmtree(getattr(self, "tmp", ""), ignore_errors=True)


def carpool_map(ds, *, workers: int = 2, cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0,
                batch_size: int = 256, **options: Any):
    """``ds`` with ``custom_id``, ``response`` and ``error`` columns added (lazily, as Ray Data does)."""
    require("ray", "carpool_map")
    import ray

    return ds.map_batches(
        CarpoolMapper,
        fn_constructor_kwargs=options,
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=workers),
        num_cpus=cpus_per_worker,
        num_gpus=gpus_per_worker or None,
    )
