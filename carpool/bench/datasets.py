"""Benchmark request sets: a workload JSONL, random lengths, or shared-prefix groups.

Every set is a list of ``BenchRequest``.  ``prompt_len`` is the prompt length in tokens
when a tokenizer was given, else an estimate (one word of the built-in vocabulary is one
token in common BPE vocabularies); the load generator replaces it with the server's
``usage.prompt_tokens`` whenever the server reports usage, so throughput figures use
the server's own count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from carpool.errors import DatasetError

# Short, common English words: each is a single token in GPT-2/Llama/SmolLM2 style vocabularies,
# so a prompt of N words is close to N tokens even without a tokenizer.
_WORD_TEXT = (
    "the of and to in is was for on are with as at be by this had not but from or have an they which "
    "one you were her all she there would their we him been has when who will more no if out so said "
    "what up its about into than them can only other new some could time these two may then do first "
    "any my now such like our over man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being under never "
    "day same another know while last might us great old year off come since against go came right "
    "used take three"
)
_WORDS = _WORD_TEXT.split()


class TextEncoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class BenchRequest:
    request_id: str
    max_tokens: int
    prompt_len: int
    messages: list[dict] | None = None
    prompt: str | None = None
    ignore_eos: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # other body fields from the workload line


def _count(tokenizer: TextEncoder | None, text: str) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False))
    return len(text.split())


def load_jsonl(
    path: str | Path,
    num_prompts: int | None = None,
    tokenizer: TextEncoder | None = None,
    default_max_tokens: int = 128,
    ignore_eos: bool = False,
) -> list[BenchRequest]:
    """Read a workload JSONL: one request per line.

    A line is either a carpool/OpenAI-chat task (``messages`` or ``prompt``, optional
    ``max_tokens``, ``custom_id``), or an OpenAI Batch line whose ``body`` holds those fields.
    """
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file; pass a workload JSONL, 'random' or 'shared-prefix'")
    out: list[BenchRequest] = []
    with path.open(encoding="utf-8-sig") as f:  # -sig: a byte order mark is no part of line 1
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            body: dict = row["body"] if isinstance(row.get("body"), dict) else row
            messages, prompt = body.get("messages"), body.get("prompt")
            if messages is None and prompt is None:
                raise DatasetError(f"{path}:{lineno}: needs a 'messages' list or a 'prompt' string")
            if messages is not None and not isinstance(messages, list):
                raise DatasetError(f"{path}:{lineno}: 'messages' must be a list of {{role, content}}")
            max_tokens = body.get("max_tokens", body.get("max_completion_tokens", default_max_tokens))
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise DatasetError(f"{path}:{lineno}: 'max_tokens' must be a positive integer")
            text = prompt if prompt is not None else " ".join(str(m.get("content", "")) for m in messages or [])
            known = {"messages", "prompt", "max_tokens", "max_completion_tokens", "model", "stream"}
            out.append(
                BenchRequest(
                    request_id=str(row.get("custom_id", f"line-{lineno}")),
                    max_tokens=max_tokens,
                    prompt_len=_count(tokenizer, text),
                    messages=messages,
                    prompt=prompt,
                    ignore_eos=bool(body.get("ignore_eos", ignore_eos)),
                    extra={k: v for k, v in body.items() if k not in known and k != "ignore_eos"},
                )
            )
            if num_prompts is not None and len(out) >= num_prompts:
                break
    if not out:
        raise DatasetError(f"{path}: no requests in the file")
    return out


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    """Integer lengths uniform in [mean*(1-r), mean*(1+r)], as vLLM's random dataset draws them."""
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def _random_text(rng: np.random.Generator, n_tokens: int, tokenizer: TextEncoder | None) -> str:
    if tokenizer is None:
        return " ".join(rng.choice(_WORDS, size=n_tokens))
    # Draw words, then trim with the real tokenizer so the prompt has exactly n tokens.
    ids = tokenizer.encode(" ".join(rng.choice(_WORDS, size=n_tokens + 8)), add_special_tokens=False)
    return tokenizer.decode(ids[:n_tokens])


def random_requests(
    num_prompts: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    seed: int = 0,
    tokenizer: TextEncoder | None = None,
) -> list[BenchRequest]:
    """Random prompts with lengths drawn around ``input_len``/``output_len``; EOS is ignored
    so each request generates exactly its drawn output length (as vLLM does for random)."""
    rng = np.random.default_rng(seed)
    ins = _lengths(rng, num_prompts, input_len, range_ratio)
    outs = _lengths(rng, num_prompts, output_len, range_ratio)
    reqs = []
    for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=False)):
        text = _random_text(rng, int(n_in), tokenizer)
        reqs.append(
            BenchRequest(
                request_id=f"random-{i}",
                max_tokens=int(n_out),
                prompt_len=_count(tokenizer, text),
                prompt=text,
                ignore_eos=True,
            )
        )
    return reqs


def shared_prefix_requests(
    num_prompts: int,
    num_prefixes: int = 4,
    prefix_len: int = 256,
    suffix_len: int = 64,
    output_len: int = 64,
    seed: int = 0,
    tokenizer: TextEncoder | None = None,
) -> list[BenchRequest]:
    """Groups of prompts that share a long prefix (a system prompt, a document), each with
    its own suffix: the workload that prefix caching speeds up.  Groups are interleaved so
    a cache must keep several prefixes alive at once."""
    if num_prefixes < 1:
        raise DatasetError("--num-prefixes must be at least 1")
    rng = np.random.default_rng(seed)
    prefixes = [_random_text(rng, prefix_len, tokenizer) for _ in range(num_prefixes)]
    reqs = []
    for i in range(num_prompts):
        text = prefixes[i % num_prefixes] + " " + _random_text(rng, suffix_len, tokenizer)
        reqs.append(
            BenchRequest(
                request_id=f"prefix{i % num_prefixes}-{i}",
                max_tokens=output_len,
                prompt_len=_count(tokenizer, text),
                prompt=text,
                ignore_eos=True,
            )
        )
    return reqs
