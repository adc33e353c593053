"""What tokens cost: ``--price-in`` / ``--price-out`` ($ per million tokens), a user price
file (``--prices FILE``), or a small built-in table of OpenAI list prices for named models.

Looked up in that order.  The price file keeps prices current without a carpool release:
JSON or YAML in the shape of LiteLLM's ``model_prices_and_context_window.json`` (that file
itself works), read for the fields carpool needs::

    {"my-llama-70b": {"input_cost_per_token": 6e-07, "output_cost_per_token": 8e-07},
     "gpt-4o-mini":  {"input_cost_per_token": 1.5e-07, "output_cost_per_token": 6e-07}}

($ per token, as LiteLLM writes them; an embedding model may leave out the output price;
other fields and LiteLLM's ``sample_spec`` entry are ignored).  A model is found by its
name, without a ``provider/`` prefix, or by its dated snapshot's family.

The built-in table is deliberately small and dated (``TABLE_DATE``); a provider's real
bill may differ (batch or prompt-cache discounts, new prices): pass the flags or a file to
be exact.  A model that is in none gets no prices, and its $ figures are shown as
unknown, never as 0.  Prompt tokens served from
the provider's prompt cache cost the table's cached-input price where it lists one; a job
through a batch API pays half of every rate (``Prices.at_batch_rate``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from carpool.errors import StartRefused
from carpool.jobs.options import FLAGS, RunOptions

# $ per million tokens (input, output): OpenAI's standard (not Batch API) list prices as
# published on openai.com/api/pricing, August 2025.  Dated snapshots ("gpt-4o-2024-08-06")
# take their family's price.  The date is shown with every figure taken from this table.
TABLE_DATE = "2025-08"
BUILTIN_PRICES: dict[str, tuple[float, float]] = {
    "gpt-5": (1.25, 10.00),
    "gpt-5-mini": (0.25, 2.00),
    "gpt-5-nano": (0.05, 0.40),
    "gpt-4.1": (2.00, 8.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4.1-nano": (0.10, 0.40),
    "gpt-4o": (2.50, 10.00),
    "gpt-4o-mini": (0.15, 0.60),
    "o3": (2.00, 8.00),
    "o3-mini": (1.10, 4.40),
    "o4-mini": (1.10, 4.40),
    "gpt-3.5-turbo": (0.50, 1.50),
    "text-embedding-3-small": (0.02, 0.0),
    "text-embedding-3-large": (0.13, 0.0),
}

# $ per million cached input tokens (prompt caching) where OpenAI lists a price for them,
# same page and date; a model not here pays the input price for cached tokens.
CACHED_INPUT: dict[str, float] = {
    "gpt-5": 0.125, "gpt-5-mini": 0.025, "gpt-5-nano": 0.005, "gpt-4.1": 0.50, "gpt-4.1-mini": 0.10,
    "gpt-4.1-nano": 0.025, "gpt-4o": 1.25, "gpt-4o-mini": 0.075, "o3": 0.50, "o3-mini": 0.55, "o4-mini": 0.275,
}
# The batch APIs (OpenAI, Azure OpenAI, Anthropic) charge half of every rate, cached input included.
BATCH_RATE = 0.5

_SNAPSHOT = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{4})$")  # -2024-08-06, -0125


@dataclass(frozen=True)
class Prices:
    input_per_m: float
    output_per_m: float
    source: str  # "--price-in/--price-out" or "built-in table (gpt-4o-mini, 2025-08)"
    cached_per_m: float | None = None  # cached input tokens; None: they cost the input price

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        """``cached_tokens``: how many of ``prompt_tokens`` the provider served from its prompt cache."""
        cached = min(cached_tokens, prompt_tokens) if self.cached_per_m is not None else 0
        return ((prompt_tokens - cached) * self.input_per_m + cached * (self.cached_per_m or 0.0)
                + completion_tokens * self.output_per_m) / 1e6

    def at_batch_rate(self) -> Prices:
        """The same prices through a batch API: half of each."""
        cached = None if self.cached_per_m is None else self.cached_per_m * BATCH_RATE
        return Prices(self.input_per_m * BATCH_RATE, self.output_per_m * BATCH_RATE,
                      f"{self.source}, at the batch rate ({BATCH_RATE:.0%})", cached)

    def doc(self) -> dict:
        doc = {"input_per_million": self.input_per_m, "output_per_million": self.output_per_m,
               "source": self.source}
        if self.cached_per_m is not None:
            doc["cached_input_per_million"] = self.cached_per_m
        return doc


def _lookup(table: dict[str, tuple[float, float]], model: str) -> tuple[str, tuple[float, float]] | None:
    """(the key found, its prices) for ``model``, its name without a provider prefix, or its family."""
    name = model.strip().lower()
    bare = name.split("/", 1)[1] if "/" in name else name
    for key in dict.fromkeys((name, bare, _SNAPSHOT.sub("", name), _SNAPSHOT.sub("", bare))):
        if key in table:
            return key, table[key]
    return None


def builtin_prices(model: str | None) -> Prices | None:
    """The table's prices for ``model`` (or its dated snapshot), else None."""
    if not model:
        return None
    found = _lookup(BUILTIN_PRICES, model)
    if found is None:
        return None
    key, (pin, pout) = found
    return Prices(pin, pout, f"built-in table ({key}, {TABLE_DATE})", CACHED_INPUT.get(key))


def _per_token(path: str, model: str, entry: dict, name: str, required: bool) -> float:
    value = entry.get(name)
    if value is None and not required:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise StartRefused(f"price file {path}: model {model!r}: {name} must be a number of $ per token, 0 or "
                         f"more (e.g. 1.5e-07 for $0.15 per million), got {value!r}")
    return float(value)


def _parse(path: str, text: str, where: str) -> object:
    if path.lower().endswith((".yaml", ".yml")):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise StartRefused(f"{where}: not valid YAML: {e}") from e
    try:
        return json.loads(text)
    except ValueError as e:
        raise StartRefused(f"{where}: not valid JSON ({e}); a .yaml/.yml file is read as YAML") from e


def load_price_file(path: str | Path, spell: Callable[..., str] = FLAGS) -> dict[str, tuple[float, float]]:
    """Model name (lower case) -> ($ per million input, $ per million output) from a JSON or
    YAML file in LiteLLM's model-prices shape; ValueError names the file, model and field
    (the setting as ``spell`` writes it: ``--prices FILE`` or ``prices='FILE'``)."""
    path = str(path)
    where = spell("prices", path)
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # -sig: a byte order mark is no part of the JSON
    except OSError as e:
        raise StartRefused(f"{where}: cannot read it ({e.strerror or e})") from e
    doc = _parse(path, text, where)
    if not isinstance(doc, dict):
        raise StartRefused(f"{where}: must map model names to their prices, e.g. "
                         '{"my-model": {"input_cost_per_token": 1e-07, "output_cost_per_token": 4e-07}}')
    table: dict[str, tuple[float, float]] = {}
    for model, entry in doc.items():
        if model == "sample_spec":  # LiteLLM's file documents its fields under this key
            continue
        if not isinstance(entry, dict):
            raise StartRefused(f"{where}: model {model!r}: must be an object with input_cost_per_token "
                             "and output_cost_per_token")
        if "input_cost_per_token" not in entry:
            continue  # priced otherwise (per image, per second...): not a token model carpool can price
        pin = _per_token(path, model, entry, "input_cost_per_token", True)
        pout = _per_token(path, model, entry, "output_cost_per_token", False)
        table[str(model).strip().lower()] = (round(pin * 1e6, 9), round(pout * 1e6, 9))
    return table


def table_prices(model: str | None, price_file: str | None, spell: Callable[..., str] = FLAGS) -> Prices | None:
    """The price file's prices for ``model``, else the built-in table's, else None."""
    if price_file and model:
        found = _lookup(load_price_file(price_file, spell), model)
        if found is not None:
            key, (pin, pout) = found
            return Prices(pin, pout, f"price file {price_file} ({key})")
    elif price_file:
        load_price_file(price_file, spell)  # checked even when no model needs it: a broken file refuses the start
    return builtin_prices(model)


def resolve_prices(model: str | None, price_in: float | None, price_out: float | None,
                   price_file: str | None = None, spell: Callable[..., str] = FLAGS) -> Prices | None:
    """The flags when given (a missing one from the tables), else the price file, else the
    built-in table; None: unknown.

    Raises ValueError when only one flag is given for a model no table knows, or the price
    file is broken."""
    for name, value in (("price_in", price_in), ("price_out", price_out)):
        if value is not None and not value >= 0:
            raise StartRefused(f"{spell(name, value)}: a price is $ per million tokens, 0 or more")
    table = table_prices(model, price_file, spell)
    if price_in is None and price_out is None:
        return table
    if price_in is not None and price_out is not None:
        return Prices(price_in, price_out, "--price-in/--price-out")
    if table is None:
        missing = spell("price_out" if price_out is None else "price_in")
        raise StartRefused(f"{missing} is missing: model {model!r} is not in the price tables, so give "
                         f"both {spell('price_in')} and {spell('price_out')} ($ per million tokens; 0 for none)")
    return Prices(price_in if price_in is not None else table.input_per_m,
                  price_out if price_out is not None else table.output_per_m,
                  f"--price-in/--price-out, the rest from the {table.source}",
                  table.cached_per_m if price_in is None else None)


def job_prices(opts: RunOptions) -> Prices | None:
    """The prices of a job's model: the flags, else the ``--prices`` file, else the built-in
    table (an endpoint's model name; the embedded engine is in no table), else None (unknown);
    through a provider's batch API, at its batch rate."""
    prices = resolve_prices(opts.defaults.model if opts.endpoints else None, opts.price_in, opts.price_out,
                            opts.prices, opts.naming)
    return prices.at_batch_rate() if prices is not None and opts.batch_api is not None else prices


def cost_doc(prices: Prices | None, prompt: int, completion: int, saved_prompt: int, saved_completion: int,
             cached: int = 0) -> dict:
    """The summary's ``cost``: $ spent on the tokens the backend answered, $ saved by the
    answers that cost nothing (cache hits, dedup fan-outs); None where prices are unknown.
    ``cached``: prompt tokens the provider's prompt cache served (billed at their own rate)."""
    if prices is None:
        return {"spent_usd": None, "saved_usd": None, "prices": None}
    return {"spent_usd": round(prices.cost(prompt, completion, cached), 6),
            "saved_usd": round(prices.cost(saved_prompt, saved_completion), 6), "prices": prices.doc()}
