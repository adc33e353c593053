"""Run the server: in the foreground (the CLI), in a background thread, or as a subprocess.

    with start_server(ServerConfig(engine=EngineConfig(model="tiny-random"), port=0)) as srv:
        openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x") ...

    with start_server_process(["--model", "tiny-random", "--port", "0"]) as srv:
        ...  # srv.base_url; the process is stopped on exit
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from carpool.embed.dynamic_batcher import DynamicBatcher
from carpool.engine.protocol import EngineClient
from carpool.server.app import build_app
from carpool.server.batch_disk import BatchDisk
from carpool.server.config import ServerConfig
from carpool.server.connections import GuardedSite, check_bindable, rate_limit_logging
from carpool.server.state import STATE, ServerState


class _Running:
    def __init__(self, runner: web.AppRunner, site: GuardedSite) -> None:
        self.runner = runner
        self.site = site

    @property
    def port(self) -> int:
        return self.site.port  # the bound port tells the real one when 0 was asked

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start(config: ServerConfig, engine: EngineClient | None = None, batcher: DynamicBatcher | None = None,
                batch_disk: BatchDisk | None = None) -> tuple[_Running, web.Application]:
    """Start serving on the running loop; returns once the engine is loaded and the port bound."""
    check_bindable(config.host, config.port)  # a taken port is refused before the model loads
    app = build_app(config, engine=engine, batcher=batcher, batch_disk=batch_disk)
    # handler_cancellation: a client that goes away cancels its handler, whose cleanup aborts
    # the engine request (frees KV blocks) even while it still waits for its first token.
    rate_limit_logging()
    # lingering_time: after answering a request whose body was not read (413, 408), aiohttp
    # reads and drops what still comes for this long before closing; 10 s by default is
    # 10 s of a hostile sender's connection held for nothing.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=config.idle_timeout_s,
                           lingering_time=2.0)
    await runner.setup()
    site = GuardedSite(runner, config.host, config.port, backlog=1024, max_connections=config.max_connections)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return _Running(runner, site), app


async def serve_forever(config: ServerConfig) -> None:
    """The CLI's loop: serve until SIGINT/SIGTERM."""
    running, app = await start(config)
    url = f"http://{config.host}:{running.port}"
    stats = app[STATE].engine.stats()
    print(f"carpool serve: listening on {url} (model {', '.join(config.model_names())}; steps of at most "
          f"{stats.get('max_num_batched_tokens', '?')} tokens and {stats.get('max_num_seqs', '?')} sequences)",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await running.stop()


@dataclass
class ServerHandle:
    base_url: str  # http://host:port (add "/v1" for OpenAI clients)
    port: int
    app: web.Application | None = None
    loop: asyncio.AbstractEventLoop | None = None
    process: subprocess.Popen | None = None

    @property
    def state(self) -> ServerState:
        assert self.app is not None, "only an in-thread server exposes its state"
        return self.app[STATE]

    @property
    def engine(self) -> EngineClient:
        return self.state.engine

    def call(self, coro, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's loop (e.g. to read engine state safely)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def start_server(config: ServerConfig | None = None, *, engine: EngineClient | None = None,
                 batcher: DynamicBatcher | None = None, batch_disk: BatchDisk | None = None,
                 timeout_s: float = 300.0) -> Iterator[ServerHandle]:
    """Serve in a background thread with its own event loop; yields a ServerHandle.

    Use ``port=0`` for a free port.  ``engine``/``batcher`` may be passed in (then they are not
    shut down on exit); otherwise they are built from ``config`` and closed on exit.
    ``batch_disk``: as ``build_app`` takes it.
    """
    config = config or ServerConfig(port=0)
    ready = threading.Event()
    box: dict[str, Any] = {}
    loop = asyncio.new_event_loop()

    async def main() -> None:
        try:
            running, app = await start(config, engine=engine, batcher=batcher, batch_disk=batch_disk)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
            ready.set()
            return
        box["running"], box["app"] = running, app
        box["stop"] = stop = asyncio.Event()
        ready.set()
        await stop.wait()
        await running.stop()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), name="carpool-server", daemon=True)
    thread.start()
    if not ready.wait(timeout_s):
        raise TimeoutError(f"carpool server did not start within {timeout_s:.0f} s")
    if "error" in box:
        thread.join()
        loop.close()
        raise box["error"]
    port = box["running"].port
    host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
    try:
        yield ServerHandle(base_url=f"http://{host}:{port}", port=port, app=box["app"], loop=loop)
    finally:
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(60)
        loop.close()


_LISTENING = re.compile(r"listening on (http://\S+)")


@contextlib.contextmanager
def start_server_process(args: list[str], *, env: dict[str, str] | None = None,
                         timeout_s: float = 300.0) -> Iterator[ServerHandle]:
    """``carpool serve ARGS`` as a subprocess (pass ``--port 0`` for a free port); yields once it
    listens and terminates it on exit.  Its output after the banner goes to this process's stderr."""
    cmd = [sys.executable, "-m", "carpool.cli", "serve", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True,
                            env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + timeout_s
        url = None
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = _LISTENING.search(line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise RuntimeError(f"carpool serve exited or never listened (exit code {proc.poll()}): {cmd}")
        # keep draining stdout so the child never blocks on a full pipe
        out = proc.stdout
        threading.Thread(target=lambda: [None for _ in out], daemon=True).start()
        yield ServerHandle(base_url=url, port=int(url.rsplit(":", 1)[1]), process=proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
