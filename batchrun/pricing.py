"""What a model call cost when the endpoint does not say.

OpenRouter puts each reply's cost in ``usage.cost``; OpenAI, Anthropic-compatible gateways, Together,
vLLM and llama.cpp do not. Such replies are priced from their token counts: by the prices the user gave
(``--price_per_mtok``), else by genai-prices' table for the model (and the provider the endpoint's URL
names, where the table knows it). With neither, the cost of such a reply is unknown, and every figure
that includes one says so rather than show $0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from batchrun.env_vars import names_host
from batchrun.rows import Usage

# Where a reply's cost came from.
CostSource = Literal["endpoint", "user", "table", "unknown"]
COST_SOURCES: tuple[CostSource, ...] = ("endpoint", "user", "table", "unknown")
# Endpoints whose replies carry their cost: a price is never needed there.
COST_REPORTING_HOSTS = ("openrouter.ai",)


@dataclass(frozen=True)
class Pricing:
    """How replies without a cost are priced: ``source`` is "user", "table" or "unknown"."""

    source: CostSource
    description: str                       # for the start-up summary and statistics.json
    per_mtok: tuple[float, float, float] = (0.0, 0.0, 0.0)   # user prices: input, output, cached input
    model_ref: str = ""                    # the table's: model and provider
    provider_id: str | None = None

    def cost(self, usage: Usage) -> float | None:
        """The reply's cost in USD, or None when no price is known. Cached input tokens are part of
        ``prompt_tokens`` and reasoning tokens part of ``completion_tokens``, as endpoints report them;
        where a gateway reports more cached tokens than prompt tokens (its prompt tokens leave them
        out), every cached token counts as read, by either price."""
        if self.source == "user":
            input_price, output_price, cached_price = self.per_mtok
            uncached = max(usage.prompt_tokens - usage.cached_tokens, 0)
            return (uncached * input_price + usage.cached_tokens * cached_price
                    + usage.completion_tokens * output_price) / 1e6
        if self.source == "table":
            from genai_prices import Usage as TableUsage
            from genai_prices import calc_price

            # The table refuses more cached tokens than input tokens (ValueError, a failed prompt).
            input_tokens = max(usage.prompt_tokens, usage.cached_tokens)
            priced = calc_price(TableUsage(input_tokens=input_tokens, cache_read_tokens=usage.cached_tokens,
                                           output_tokens=usage.completion_tokens),
                                self.model_ref, provider_id=self.provider_id)
            return float(priced.total_price)
        return None

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"source": self.source, "description": self.description}
        if self.source == "user":
            found["usd_per_million_tokens"] = dict(zip(("input", "output", "cached_input"), self.per_mtok,
                                                       strict=True))
        return found


def reports_cost(base_url: str) -> bool:
    """Whether the endpoint puts each reply's cost in its usage."""
    return any(names_host(base_url, known) for known in COST_REPORTING_HOSTS)


def resolve_pricing(model: str, base_url: str, user_prices: tuple[float, float, float] | None) -> Pricing:
    """The user's prices; else the table's for this model, at the provider the URL names if the table
    knows it, else at the provider the table finds likeliest for the model; else none."""
    if user_prices is not None:
        input_price, output_price, cached_price = user_prices
        return Pricing("user", f"--price_per_mtok: ${input_price:g} input, ${output_price:g} output, "
                               f"${cached_price:g} cached input per million tokens", per_mtok=user_prices)
    from genai_prices import Usage as TableUsage
    from genai_prices import calc_price

    probe = TableUsage(input_tokens=1_000_000, output_tokens=1_000_000)
    for by_url in (True, False):
        try:
            found = (calc_price(probe, model, provider_api_url=base_url) if by_url else calc_price(probe, model))
        except LookupError:
            continue
        where = "" if by_url else " (not a provider the table knows by this URL: its likeliest provider's price)"
        prices = ", ".join(str(found.model_price).split(", ")[:3])      # input, output, cached input
        return Pricing("table", f"genai-prices: {found.model.name} at {found.provider.name}, {prices}{where}",
                       model_ref=model, provider_id=found.provider.id)
    return Pricing("unknown", f"no price known for model {model!r}: genai-prices has none, and no "
                              "--price_per_mtok was given")
