"""What tokens cost: ``--price-in`` / ``--price-out`` ($ per million tokens), or a small
built-in table of OpenAI list prices for named models.

The table is deliberately small and dated; a provider's real bill may differ (new prices,
long-context tiers): pass the flags to be exact.  A model that is in neither gets no
prices, and its $ figures are shown as unknown, never as 0.  Prompt tokens served from
the provider's prompt cache cost the table's cached-input price where it lists one; a job
through a batch API pays half of every rate (``Prices.at_batch_rate``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# $ per million tokens (input, output): OpenAI's standard (not Batch API) list prices as
# published on openai.com/api/pricing, August 2025.  Dated snapshots ("gpt-4o-2024-08-06")
# take their family's price.
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


def builtin_prices(model: str | None) -> Prices | None:
    """The table's prices for ``model`` (or its dated snapshot), else None."""
    if not model:
        return None
    name = model.strip().lower().removeprefix("openai/")
    family = _SNAPSHOT.sub("", name)
    for key in (name, family):
        if key in BUILTIN_PRICES:
            pin, pout = BUILTIN_PRICES[key]
            return Prices(pin, pout, f"built-in table ({key}, {TABLE_DATE})", CACHED_INPUT.get(key))
    return None


def resolve_prices(model: str | None, price_in: float | None, price_out: float | None) -> Prices | None:
    """The flags when given (a missing one from the table), else the table; None: unknown.

    Raises ValueError when only one flag is given for a model the table does not know."""
    for flag, value in (("--price-in", price_in), ("--price-out", price_out)):
        if value is not None and not value >= 0:
            raise ValueError(f"{flag} {value}: a price is $ per million tokens, 0 or more")
    if price_in is None and price_out is None:
        return builtin_prices(model)
    table = builtin_prices(model)
    if price_in is not None and price_out is not None:
        return Prices(price_in, price_out, "--price-in/--price-out")
    if table is None:
        missing = "--price-out" if price_out is None else "--price-in"
        raise ValueError(f"{missing} is missing: model {model!r} is not in the built-in price table, so give "
                         "both --price-in and --price-out ($ per million tokens; 0 for none)")
    return Prices(price_in if price_in is not None else table.input_per_m,
                  price_out if price_out is not None else table.output_per_m,
                  f"--price-in/--price-out, the rest from the {table.source}",
                  table.cached_per_m if price_in is None else None)


def cost_doc(prices: Prices | None, prompt: int, completion: int, saved_prompt: int, saved_completion: int,
             cached: int = 0) -> dict:
    """The summary's ``cost``: $ spent on the tokens the backend answered, $ saved by the
    answers that cost nothing (cache hits, dedup fan-outs); None where prices are unknown.
    ``cached``: prompt tokens the provider's prompt cache served (billed at their own rate)."""
    if prices is None:
        return {"spent_usd": None, "saved_usd": None, "prices": None}
    return {"spent_usd": round(prices.cost(prompt, completion, cached), 6),
            "saved_usd": round(prices.cost(saved_prompt, saved_completion), 6), "prices": prices.doc()}
