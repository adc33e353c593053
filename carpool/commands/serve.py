"""``carpool serve``: flags named as vLLM names them (plus Triton's for the embedding batcher)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from carpool.commands import flags
from carpool.engine.config import SERVER_MAX_NUM_BATCHED_TOKENS, SERVER_MAX_NUM_SEQS, EngineConfig
from carpool.server.config import ServerConfig


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 8,16,32, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    d_engine, d_server = EngineConfig(), ServerConfig()
    g = p.add_argument_group("model and engine (vLLM names)")
    g.add_argument("--model", default=d_engine.model,
                   help="smollm2 (packaged SmolLM2-135M-Instruct), tiny-random, or a HF folder")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the --model value)")
    g.add_argument("--dtype", default=d_engine.dtype, help="auto (bf16 where the CPU has it), bfloat16, float32")
    g.add_argument("--quantization", default=d_engine.quantization, choices=["int8"],
                   help="int8: int8 linear weights, per-output-channel scales; measured 1.24-1.29x "
                        "bf16's decode tok/s on a 2-core Zen 4 (docs/engine.md); default: none")
    g.add_argument("--kv-cache-dtype", default=d_engine.kv_cache_dtype, choices=["auto", "int8"],
                   help="int8: keys and values stored in int8 with a scale per token and head (half the "
                        "bytes a decode step reads, twice the tokens per GB); auto: the model dtype")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=SERVER_MAX_NUM_SEQS,
                   help="sequences a step runs at most: each lengthens every user's time between two tokens "
                        f"(default {SERVER_MAX_NUM_SEQS}; offline jobs take the engine plan's measured one)")
    g.add_argument("--max-num-batched-tokens", type=int, default=SERVER_MAX_NUM_BATCHED_TOKENS,
                   help="tokens of a step at most: what an arriving request may wait before its first token "
                        f"(default {SERVER_MAX_NUM_BATCHED_TOKENS}; offline jobs take the engine plan's measured one)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d_engine.enable_prefix_caching)
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority", "lof"], default=d_engine.scheduling_policy)
    g.add_argument("--block-size", type=int, default=d_engine.block_size)
    g.add_argument("--kv-cache-memory-gb", type=float, default=d_engine.kv_cache_memory_gb)
    g.add_argument("--seed", type=int, default=d_engine.seed)

    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default=d_server.host)
    g.add_argument("--port", type=int, default=d_server.port, help="0: any free port (printed at start)")
    g.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                        "$CARPOOL_API_KEY); give it again for more keys: each sees only the files and "
                        "batches created with it")
    g.add_argument("--idle-timeout", type=flags.duration, metavar="DURATION", default=d_server.idle_timeout_s,
                   help="close a connection that sends no (whole) request for this many seconds")
    g.add_argument("--body-timeout", type=flags.duration, metavar="DURATION", default=d_server.body_timeout_s,
                   help="seconds a request body may take to arrive (then 408)")
    g.add_argument("--max-connections", type=int, default=None,
                   help="open connections past this get a 503 (default: from the file-descriptor limit)")

    g = p.add_argument_group("admission control")
    g.add_argument("--max-queue-size", type=int, default=d_server.max_queue_size,
                   help="waiting requests (no token out yet) beyond which new ones get 429; 0: no limit")
    g.add_argument("--max-queued-tokens", type=int, default=0,
                   help="waiting prompt tokens beyond which new requests get 429; 0: no limit")
    g.add_argument("--max-choices-per-request", type=int, default=d_server.max_choices_per_request,
                   help="prompts x n one request may ask for (a /v1/completions prompt list); past it a 400 "
                        "naming 'prompt'; 0: no limit")
    g.add_argument("--grammar-timeout", type=float, default=d_server.grammar_timeout_s,
                   help="seconds a request's grammar (schema, choice, regex, Lark) may take to compile; "
                        "past it a 400 naming the field")
    g.add_argument("--max-grammar-bytes", type=int, default=d_server.max_grammar_bytes,
                   help="largest grammar source (schema, choices, regex, Lark) compiled; past it a 400")

    g = p.add_argument_group("embeddings (dynamic batcher)")
    g.add_argument("--embedding-model", default=d_server.embedding_model,
                   help="embedding model to serve on /v1/embeddings; 'none' to disable")
    g.add_argument("--max-queue-delay-us", type=int, default=d_server.max_queue_delay_us)
    g.add_argument("--preferred-batch-sizes", type=_sizes, default=d_server.preferred_batch_sizes)
    g.add_argument("--max-batch-tokens", type=int, default=d_server.max_batch_tokens)
    g.add_argument("--embedding-queue-timeout-ms", type=int, default=d_server.embedding_queue_timeout_ms,
                   help="an embedding request that waited longer gets 503 with Retry-After")
    g = p.add_argument_group("Files and Batches API (/v1/files, /v1/batches)")
    g.add_argument("--batch-dir", default=None,
                   help="where files and batch state live (SQLite + a directory); default: <cache dir>/batches")
    g.add_argument("--batch-max-file-mb", type=float, default=d_server.max_batch_file_bytes / 1e6,
                   help="largest uploaded file, in MB (OpenAI's limit: 200)")
    g.add_argument("--batch-max-requests", type=int, default=d_server.max_batch_requests,
                   help="most requests in one batch input file (OpenAI's limit: 50,000)")
    g.add_argument("--batch-max-inflight", type=int, default=d_server.batch_max_inflight,
                   help="batch requests in the engine at once, all batches together; online requests "
                        "always come first")
    g.add_argument("--batch-max-seqs", type=int, default=None,
                   help="engine sequences batch requests may hold at once, all batches together (a line "
                        "with n: 16 holds 16); default: three quarters of --max-num-seqs")
    p.add_argument("--log-level", default="warning")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
    )
    embedding = None if str(args.embedding_model).lower() in ("", "none") else args.embedding_model
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        served_model_names=list(args.served_model_name or []),
        api_keys=[k for k in (args.api_key or [os.environ.get("CARPOOL_API_KEY")]) if k],
        max_queue_size=args.max_queue_size or None,
        max_queued_tokens=args.max_queued_tokens or None,
        max_choices_per_request=args.max_choices_per_request or None,
        grammar_timeout_s=args.grammar_timeout,
        max_grammar_bytes=args.max_grammar_bytes,
        embedding_model=embedding,
        max_queue_delay_us=args.max_queue_delay_us,
        preferred_batch_sizes=args.preferred_batch_sizes,
        max_batch_tokens=args.max_batch_tokens,
        embedding_queue_timeout_ms=args.embedding_queue_timeout_ms,
        idle_timeout_s=args.idle_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        batch_dir=args.batch_dir,
        max_batch_file_bytes=int(args.batch_max_file_mb * 1e6),
        max_batch_requests=args.batch_max_requests,
        batch_max_inflight=args.batch_max_inflight,
        batch_max_seqs=args.batch_max_seqs,
    )


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from carpool.errors import CarpoolError
    from carpool.server.launcher import serve_forever

    try:
        asyncio.run(serve_forever(config_from_args(args)))
    except KeyboardInterrupt:
        return 0
    except OSError as e:  # taken between the check before the model loads (a StartRefused) and the start
        print(f"carpool serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # EngineError, a model that cannot load, a bad setting, a port taken: say which
        # carpool's own errors are written for the user; another ValueError is named by its type.
        kind = "" if isinstance(e, CarpoolError) else f"{type(e).__name__}: "
        print(f"carpool serve: {kind}{e}", file=sys.stderr)
        return 2
    return 0
