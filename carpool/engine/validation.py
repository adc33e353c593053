"""Checks every ``SamplingParams`` field once, when a request enters the engine.

A bad value must be refused here with an ``EngineError`` that names the field (the
OpenAI layer turns it into a 400), never reach the sampler: there a NaN temperature, a
top_k of 1e30 or a subnormal float once raised inside the batched step and took every
other request down with it.  The sampler still computes defensively (see sampler.py);
this is the first line.
"""

from __future__ import annotations

import math
from typing import TypeGuard

from carpool.errors import EngineError

from .protocol import SamplingParams, StructuredOutputs

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (and vLLM's default max_logprobs)
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 4096  # entries; OpenAI allows 300, the bound only keeps a step cheap


def _show(v: object) -> str:
    """repr of a value, cut so an error never echoes a megabyte back."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _float(rid: str, name: str, v: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``v`` as a finite float in [lo, hi] (or (lo, hi]), else an EngineError naming ``name``."""
    if not _is_number(v):
        raise EngineError(f"request {rid}: {name} must be a number, got {_show(v)}")
    try:
        x = float(v)
    except OverflowError:  # an int too large for a float
        x = math.inf
    if not math.isfinite(x):
        raise EngineError(f"request {rid}: {name} must be a finite number, got {_show(v)}")
    low_ok = x > lo if lo_open else x >= lo
    if not low_ok or x > hi:
        bracket = "(" if lo_open else "["
        raise EngineError(f"request {rid}: {name} must be in {bracket}{lo:g}, {hi:g}], got {_show(v)}")
    return x


def _int(rid: str, name: str, v: object, lo: int | None, hi: int | None = None) -> int:
    if not _is_int(v):
        raise EngineError(f"request {rid}: {name} must be an integer, got {_show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise EngineError(f"request {rid}: {name} must be {where}, got {_show(v)}")
    return v


def _token_id(rid: str, name: str, v: object, vocab_size: int) -> int:
    if not _is_int(v) or not 0 <= v < vocab_size:
        raise EngineError(f"request {rid}: {name} must hold token ids in [0, {vocab_size}), got {_show(v)}")
    return v


def check_sampling_params(p: SamplingParams, vocab_size: int, rid: str) -> None:
    """Raise ``EngineError`` for the first field of ``p`` the engine cannot run."""
    if not isinstance(p, SamplingParams):
        raise EngineError(f"request {rid}: params must be a SamplingParams, got {type(p).__name__}")
    # No upper bound on temperature: a huge one is the uniform distribution (the sampler caps it).
    _float(rid, "temperature", p.temperature, 0.0, math.inf)
    _float(rid, "top_p", p.top_p, 0.0, 1.0, lo_open=True)
    _float(rid, "min_p", p.min_p, 0.0, 1.0)
    # Any integer: <= 0 is off, above the vocabulary is the whole vocabulary (the sampler clamps).
    _int(rid, "top_k", p.top_k, None)
    _int(rid, "max_tokens", p.max_tokens, 1)
    _int(rid, "min_tokens", p.min_tokens, 0, p.max_tokens)
    _float(rid, "presence_penalty", p.presence_penalty, -2.0, 2.0)
    _float(rid, "frequency_penalty", p.frequency_penalty, -2.0, 2.0)
    _float(rid, "repetition_penalty", p.repetition_penalty, 0.0, math.inf, lo_open=True)
    if p.seed is not None:
        _int(rid, "seed", p.seed, -(2**63), 2**64 - 1)
    if not isinstance(p.ignore_eos, bool):
        raise EngineError(f"request {rid}: ignore_eos must be true or false, got {_show(p.ignore_eos)}")
    if not isinstance(p.stop, list) or not all(isinstance(s, str) for s in p.stop):
        raise EngineError(f"request {rid}: stop must be a list of strings, got {_show(p.stop)}")
    if not isinstance(p.stop_token_ids, list) or len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise EngineError(f"request {rid}: stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} "
                          f"token ids, got {_show(p.stop_token_ids)}")
    for t in p.stop_token_ids:
        _token_id(rid, "stop_token_ids", t, vocab_size)
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict) or len(p.logit_bias) > MAX_LOGIT_BIAS:
            raise EngineError(f"request {rid}: logit_bias must be a dict of at most {MAX_LOGIT_BIAS} "
                              f"token id -> bias entries, got {_show(p.logit_bias)}")
        for t, b in p.logit_bias.items():
            _token_id(rid, "logit_bias", t, vocab_size)
            # Any finite bias; it is clamped to [-100, 100] when applied, as OpenAI does.
            _float(rid, f"logit_bias[{t}]", b, -math.inf, math.inf)
    if p.logprobs is not None:
        _int(rid, "logprobs", p.logprobs, 0, MAX_LOGPROBS)
    if p.structured_outputs is not None:
        check_structured_outputs(p.structured_outputs, rid)


def check_structured_outputs(so: object, rid: str) -> None:
    """Exactly one grammar kind, of the right type (the grammar itself is checked when compiled)."""
    if not isinstance(so, StructuredOutputs):
        raise EngineError(f"request {rid}: structured_outputs must be a StructuredOutputs, got {type(so).__name__}")
    given = [name for name, v in (("json", so.json), ("regex", so.regex), ("choice", so.choice),
                                  ("grammar", so.grammar)) if v is not None]
    if so.json_object:
        given.append("json_object")
    if len(given) != 1:
        raise EngineError(f"request {rid}: structured_outputs needs exactly one of json, json_object, regex, "
                          f"choice, grammar; got {', '.join(given) or 'none'}")
    if so.json is not None and not isinstance(so.json, (dict, str, bool)):
        raise EngineError(f"request {rid}: structured_outputs.json must be a JSON Schema (a dict or its JSON "
                          f"text), got {type(so.json).__name__}")
    if so.regex is not None and not isinstance(so.regex, str):
        raise EngineError(f"request {rid}: structured_outputs.regex must be a string")
    if so.grammar is not None and not isinstance(so.grammar, str):
        raise EngineError(f"request {rid}: structured_outputs.grammar must be a string (Lark)")
    if so.choice is not None and (not isinstance(so.choice, list) or not so.choice
                                  or not all(isinstance(c, str) and c for c in so.choice)):
        raise EngineError(f"request {rid}: structured_outputs.choice must be a non-empty list of non-empty strings")
