"""Cost on every endpoint: the reply's own cost, else tokens priced by the user's prices or genai-prices'
table, else unknown (never $0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import batch_rows, run_cli, write_dataset
from scripted_endpoint import ScriptedEndpoint

from batchrun.pricing import resolve_pricing
from batchrun.rows import Usage

PROMPTS = ["first", "[[call web_search {\"query\": \"q\"}]] second", "third"]
REPLIES = 4                     # one model call each, two for the prompt with a tool call


def priced_run(tmp_path: Path, *flags: str, reports_cost: bool = False, model: str = "scripted-model",
               expect: int = 0):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS)
    with ScriptedEndpoint(reports_cost=reports_cost) as server:
        result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run",
                         "--distribution=minimal", f"--base_url={server.base_url}", f"--model={model}", *flags)
    assert result.returncode == expect, result.stderr
    return result


def statistics(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())


def table_cost_of_replies(model: str, replies: int) -> float:
    """What genai-prices says the scripted endpoint's replies cost (100 prompt tokens, 10 of them cached,
    20 completion tokens each)."""
    from genai_prices import Usage as TableUsage
    from genai_prices import calc_price

    one = calc_price(TableUsage(input_tokens=100, cache_read_tokens=10, output_tokens=20), model)
    return replies * float(one.total_price)


def test_user_prices_price_each_reply_by_its_tokens():
    pricing = resolve_pricing("any-model", "http://127.0.0.1:1/v1", (2.0, 8.0, 0.5))
    cost = pricing.cost(Usage(prompt_tokens=1_000, cached_tokens=200, completion_tokens=100))
    assert cost == pytest.approx((800 * 2.0 + 200 * 0.5 + 100 * 8.0) / 1e6)


def test_a_reply_with_more_cached_tokens_than_prompt_tokens_is_priced_by_the_table_as_the_users_prices_do():
    # Before: genai-prices refused such usage (ValueError: cache_read_tokens cannot exceed input_tokens),
    # and the session ended as an internal_error failure row holding a traceback, its reply's tokens
    # never counted. Some gateways report prompt tokens without the cached ones; all cached are read.
    from genai_prices import Usage as TableUsage
    from genai_prices import calc_price

    pricing = resolve_pricing("gpt-4o", "http://127.0.0.1:1/v1", None)
    cost = pricing.cost(Usage(prompt_tokens=10, cached_tokens=1_000, completion_tokens=20))
    expected = calc_price(TableUsage(input_tokens=1_000, cache_read_tokens=1_000, output_tokens=20), "gpt-4o")
    assert cost == pytest.approx(float(expected.total_price))


def test_without_a_cost_in_the_reply_a_run_costs_its_tokens_at_the_users_prices(tmp_path):
    priced_run(tmp_path, "--price_per_mtok=2,8,0.5")
    figures = statistics(tmp_path)
    per_reply = (90 * 2.0 + 10 * 0.5 + 20 * 8.0) / 1e6
    assert figures["usage"]["cost"] == pytest.approx(REPLIES * per_reply)
    assert sum(row["usage"]["cost"] for row in batch_rows(tmp_path / "data" / "run")) == pytest.approx(
        REPLIES * per_reply)
    assert figures["this_run"]["replies_by_cost_source"] == {"user": REPLIES}
    assert figures["pricing"]["source"] == "user"
    assert figures["pricing"]["usd_per_million_tokens"] == {"input": 2.0, "output": 8.0, "cached_input": 0.5}


def test_cached_input_costs_what_input_does_unless_priced_apart(tmp_path):
    priced_run(tmp_path, "--price_per_mtok=3,6")
    assert statistics(tmp_path)["usage"]["cost"] == pytest.approx(REPLIES * (100 * 3.0 + 20 * 6.0) / 1e6)


def test_without_a_cost_in_the_reply_a_model_in_the_price_table_costs_its_tokens_at_the_tables_prices(tmp_path):
    result = priced_run(tmp_path, model="gpt-4o")
    figures = statistics(tmp_path)
    assert figures["usage"]["cost"] == pytest.approx(table_cost_of_replies("gpt-4o", REPLIES))
    assert figures["this_run"]["replies_by_cost_source"] == {"table": REPLIES}
    assert figures["pricing"]["source"] == "table"
    assert "genai-prices: gpt 4o at OpenAI" in result.stdout


def test_the_users_prices_win_over_the_table(tmp_path):
    priced_run(tmp_path, "--price_per_mtok=1,1", model="gpt-4o")
    assert statistics(tmp_path)["usage"]["cost"] == pytest.approx(REPLIES * 120 / 1e6)


def test_a_cost_the_endpoint_reports_is_taken_as_it_is(tmp_path):
    priced_run(tmp_path, "--price_per_mtok=100,100", model="gpt-4o", reports_cost=True)
    figures = statistics(tmp_path)
    assert figures["usage"]["cost"] == pytest.approx(REPLIES * 0.001)
    assert figures["this_run"]["replies_by_cost_source"] == {"endpoint": REPLIES}


def test_with_no_price_known_the_cost_is_said_to_be_unknown_not_zero(tmp_path):
    result = priced_run(tmp_path)
    said = " ".join(result.stdout.split())
    assert said.count("else unknown: no price known for model 'scripted-model'") == 1
    assert "--price_per_mtok=INPUT,OUTPUT" in said
    assert f"cost unknown ({REPLIES} replies without a price)" in result.stdout
    assert "$0.0000" not in result.stdout
    assert statistics(tmp_path)["this_run"]["replies_by_cost_source"] == {"unknown": REPLIES}
    page = (tmp_path / "data" / "run" / "report.html").read_text()
    assert f"{REPLIES} replies without a price" in page


def test_max_cost_with_no_price_known_is_refused_saying_how_to_give_one(tmp_path):
    result = priced_run(tmp_path, "--max_cost=1", expect=1)
    assert "--max_cost needs to know what replies cost" in result.stderr
    assert "--price_per_mtok=INPUT,OUTPUT" in result.stderr
    assert not (tmp_path / "data" / "run").exists()


def test_max_cost_counts_what_the_users_prices_say_replies_cost(tmp_path):
    # Each reply costs 1,000 * 120 tokens / 1e6 = $0.12; a cap of $0.1 admits no prompt after the first replies.
    result = priced_run(tmp_path, "--price_per_mtok=1000,1000", "--max_cost=0.1", "--num_workers=1")
    assert "spending cap reached" in result.stdout
    assert len(batch_rows(tmp_path / "data" / "run")) < len(PROMPTS)


@pytest.mark.parametrize("value", ["1", "a,b", "1,2,3,4", "-1,2"])
def test_a_bad_price_per_mtok_gets_one_error_naming_the_flag(tmp_path, value):
    result = priced_run(tmp_path, f"--price_per_mtok={value}", expect=1)
    assert "--price_per_mtok takes INPUT,OUTPUT[,CACHED]" in result.stderr


def test_a_price_per_mtok_above_a_dollar_a_token_is_refused(tmp_path):
    # Before: 1e308 passed the check; each reply then cost inf, every prompt failed with an internal error
    # (a traceback, its usage dropped from its row) and statistics.json held NaN, which no JSON reader takes.
    result = priced_run(tmp_path, "--price_per_mtok=1e308,1", expect=1)
    assert "--price_per_mtok takes INPUT,OUTPUT[,CACHED]" in result.stderr
    assert "at most $1,000,000" in result.stderr
    assert not (tmp_path / "data" / "run").exists()


def test_a_reply_without_usage_has_an_unknown_cost_not_a_price_of_no_tokens(tmp_path):
    # Before: such a reply was priced as 0 tokens at the user's prices: the run said it cost $0.0000
    # (replies_by_cost_source {"user": 4}) though the endpoint billed every reply.
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS)
    with ScriptedEndpoint(reports_cost=False, reports_usage=False) as server:
        result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run",
                         "--distribution=minimal", f"--base_url={server.base_url}", "--model=scripted-model",
                         "--price_per_mtok=1,1")
    assert result.returncode == 0, result.stderr
    assert statistics(tmp_path)["this_run"]["replies_by_cost_source"] == {"unknown": REPLIES}
    assert f"cost unknown ({REPLIES} replies without a price)" in result.stdout
    assert "$0.0000" not in result.stdout


def test_max_cost_admits_no_prompt_once_a_replys_cost_is_unknown(tmp_path):
    # Before: replies without usage counted $0, and a run under --max_cost=0.000001 ran every prompt.
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS)
    with ScriptedEndpoint(reports_cost=False, reports_usage=False) as server:
        result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run",
                         "--distribution=minimal", f"--base_url={server.base_url}", "--model=scripted-model",
                         "--price_per_mtok=1,1", "--max_cost=0.000001", "--num_workers=1")
    assert result.returncode == 0, result.stderr
    assert len(batch_rows(tmp_path / "data" / "run")) == 1
    said = " ".join(result.stdout.split())
    assert "Stopped admitting prompts: --max_cost cannot be held: the cost of 1 reply is unknown" in said


def test_a_resume_under_max_cost_admits_no_prompt_once_an_earlier_replys_cost_was_unknown(tmp_path):
    # Before: each --resume forgot the unknown cost and started --num_workers more prompts before stopping.
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS)
    flags = (f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run", "--distribution=minimal",
             "--model=scripted-model", "--price_per_mtok=1,1", "--max_cost=0.000001", "--num_workers=1")
    with ScriptedEndpoint(reports_cost=False, reports_usage=False) as server:
        run_cli(tmp_path, *flags, f"--base_url={server.base_url}")
        resumed = run_cli(tmp_path, *flags, f"--base_url={server.base_url}", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert len(batch_rows(tmp_path / "data" / "run")) == 1
    said = " ".join(resumed.stdout.split())
    assert "Stopped admitting prompts: --max_cost cannot be held: the cost of 1 reply is unknown" in said


def resumed_after_an_unpriced_reply(tmp_path: Path):
    """A run whose first invocation had one reply without usage or price, resumed against an endpoint that
    reports usage (priced by --price_per_mtok)."""
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS)
    flags = (f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run", "--distribution=minimal",
             "--model=scripted-model", "--price_per_mtok=1,1")
    with ScriptedEndpoint(reports_cost=False, reports_usage=False) as server:
        run_cli(tmp_path, *flags, f"--base_url={server.base_url}", "--max_samples=1")
    with ScriptedEndpoint(reports_cost=False) as server:
        resumed = run_cli(tmp_path, *flags, f"--base_url={server.base_url}", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    return resumed


def test_a_resumed_runs_cost_says_it_is_unknown_where_an_earlier_invocations_reply_had_no_price(tmp_path):
    # Before: statistics and the console counted such replies of this invocation only: the whole run's
    # cost read as known after a --resume whose replies were priced.
    resumed = resumed_after_an_unpriced_reply(tmp_path)
    assert statistics(tmp_path)["replies_by_cost_source"] == {"unknown": 1, "user": REPLIES - 1}
    assert statistics(tmp_path)["this_run"]["replies_by_cost_source"] == {"user": REPLIES - 1}
    assert "1 reply without a price" in " ".join(resumed.stdout.split())


def test_a_resumed_runs_report_says_its_cost_leaves_out_an_earlier_invocations_reply_without_a_price(tmp_path):
    resumed_after_an_unpriced_reply(tmp_path)
    page = (tmp_path / "data" / "run" / "report.html").read_text(encoding="utf-8")
    assert "1 reply without a price" in page


def test_a_resume_under_max_cost_says_an_earlier_invocations_unpriced_reply_is_not_repriced_and_how_to_go_on(
        tmp_path):
    # Before: it said no price applies (the resume gave one) and that the endpoint reported no usage (it had).
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS)
    flags = (f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run", "--distribution=minimal",
             "--model=scripted-model")
    with ScriptedEndpoint(reports_cost=False) as server:
        run_cli(tmp_path, *flags, f"--base_url={server.base_url}", "--max_samples=1")
        resumed = run_cli(tmp_path, *flags, f"--base_url={server.base_url}", "--resume", "--price_per_mtok=1,1",
                          "--max_cost=100")
    assert resumed.returncode == 0, resumed.stderr
    said = " ".join(resumed.stdout.split())
    assert ("--max_cost cannot be held: the cost of 1 reply is unknown (1 reply of earlier invocations, which no "
            "price priced then: a price given now prices only the replies to come); run on without --max_cost, or "
            "under a new --run_name") in said
