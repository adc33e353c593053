"""The Python API as a LiteLLM / vLLM / Curator user expects it: typed keyword arguments,
one endpoint as a string, prompt strings in, answers as ``.text``, ``response_format``
parsed and checked per row, and (in-process) one warm engine across calls.

Against the fault server (a real HTTP server on 127.0.0.1); with ``echo`` it answers with
what the user message says, so a test chooses the JSON the "model" returns.
"""

import inspect
import json

import pytest

import carpool
from carpool.testing.fault_server import FaultConfig

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


@pytest.fixture
def echo(fault_server):
    return fault_server(FaultConfig(models=["m"], echo=True))


def test_run_batch_is_listed_and_documented():
    assert {"run_batch", "arun_batch", "Result"} <= set(dir(carpool))
    params = inspect.signature(carpool.run_batch).parameters
    for name in ("endpoint", "endpoints", "model", "response_format", "max_tokens", "temperature",
                 "concurrency", "output", "template", "cache"):
        assert name in params, name
    doc = inspect.getdoc(carpool.run_batch)
    assert "endpoint / endpoints" in doc and "response_format" in doc and "Returns" in doc


@pytest.mark.parametrize("how", ["endpoints", "endpoint"])
def test_a_string_endpoint_and_prompt_strings(echo, how):
    results = carpool.run_batch(["hello there", "good bye"], **{how: echo.url}, model="m", max_tokens=8,
                                cache="off", progress=False)
    assert [r.text for r in results] == ["hello there", "good bye"]
    assert all(r.ok and r["error"] is None for r in results)
    assert results[0]["text"] == "hello there"  # a dict too, the output line with the text at hand
    assert results[0]["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    assert echo.server.status_counts[200] == 2


def test_both_endpoint_and_endpoints_or_a_misspelt_option_are_refused(echo):
    with pytest.raises(TypeError, match="not both"):
        carpool.run_batch(["x"], endpoint=echo.url, endpoints=[echo.url], model="m")
    with pytest.raises(TypeError, match="did you mean 'max_pending'"):
        carpool.run_batch(["x"], endpoint=echo.url, model="m", max_pendin=3)
    assert echo.server.status_counts[200] == 0


def test_response_format_dict_parsed_and_checked_per_row(echo):
    prompts = ['{"name": "Ada", "age": 36}', '{"name": "Bob", "age": "old"}', "not json at all"]
    results = carpool.run_batch(prompts, endpoint=echo.url, model="m", response_format=RF, cache="off",
                                progress=False)
    assert results[0].parsed == {"name": "Ada", "age": 36} and results[0].ok
    assert results[1].parsed is None and not results[1].ok
    assert "age" in results[1].parse_error and "not of type 'integer'" in results[1].parse_error
    assert results[2].parse_error.startswith("the answer is not JSON")
    # The answer text stays as it came; the request carried the schema.
    assert results[1].text == prompts[1]
    assert all(r["error"] is None for r in results)


def test_response_format_pydantic_model_gives_instances(echo):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    results = carpool.run_batch(['{"name": "Ada", "age": 36}', '{"name": "Ada"}'], endpoint=echo.url, model="m",
                                response_format=Person, cache="off", progress=False)
    assert isinstance(results[0].parsed, Person) and results[0].parsed.age == 36
    assert results[1].parsed is None and "age" in results[1].parse_error


def test_structured_columns_in_a_dataframe_and_the_jsonl_output(echo, tmp_path):
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"q": ['{"name": "Ada", "age": 36}', '{"name": 1, "age": 2}']})
    out = carpool.run_batch(df, template="{q}", endpoint=echo.url, model="m", response_format=RF,
                            cache="off", progress=False)
    assert out["parsed"][0] == {"name": "Ada", "age": 36} and pd.isna(out["parse_error"][0])
    assert out["parsed"][1] is None and "name" in out["parse_error"][1]
    journal = tmp_path / "out.jsonl"
    carpool.run_batch(df, journal, template="{q}", endpoint=echo.url, model="m", response_format=RF,
                      cache="off", progress=False)
    lines = sorted((json.loads(x) for x in journal.read_text().splitlines()), key=lambda d: d["custom_id"])
    assert lines[0]["parsed"] == {"name": "Ada", "age": 36} and "parse_error" not in lines[0]
    assert "parsed" not in lines[1] and "name" in lines[1]["parse_error"]


def test_a_bad_response_format_is_refused_before_sending(echo):
    with pytest.raises(TypeError, match="response_format"):
        carpool.run_batch(["x"], endpoint=echo.url, model="m", response_format="json")
    assert echo.server.status_counts[200] == 0


def test_csv_output_from_python_and_the_cli(echo, tmp_path):
    import csv
    import subprocess
    import sys

    out = tmp_path / "out.csv"
    rows = [{"custom_id": "a", "messages": [{"role": "user", "content": '{"name": "Ada", "age": 36}'}],
             "metadata": {"team": "x", "n": 1}},
            {"custom_id": "b", "messages": [{"role": "user", "content": "not, json"}], "metadata": {"team": "y"}}]
    results = carpool.run_batch(rows, out, endpoint=echo.url, model="m", response_format=RF, cache="off",
                                progress=False, ordered=True)
    assert [r.custom_id for r in results] == ["a", "b"]  # read back from the journal beside the table
    table = list(csv.DictReader(out.open(encoding="utf-8", newline="")))
    assert [r["custom_id"] for r in table] == ["a", "b"]
    assert json.loads(table[0]["parsed"]) == {"name": "Ada", "age": 36} and table[0]["parse_error"] == ""
    assert table[1]["content"] == "not, json" and table[1]["parse_error"].startswith("the answer is not JSON")
    assert table[0]["team"] == "x" and table[0]["n"] == "1" and table[1]["n"] == ""
    assert (tmp_path / "out.csv.jsonl").exists()
    # The CLI's -o out.csv: the same table.
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli = tmp_path / "cli.csv"
    proc = subprocess.run([sys.executable, "-m", "carpool.cli", "run", str(src), "-o", str(cli), "--endpoint",
                           echo.url, "--model", "m", "--cache", "off", "--ordered"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = list(csv.DictReader(cli.open(encoding="utf-8", newline="")))
    assert [r["content"] for r in got] == [r["content"] for r in table]


def test_parquet_output_has_the_structured_columns(echo, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "out.parquet"
    carpool.run_batch(['{"name": "Ada", "age": 36}', "[1]"], out, endpoint=echo.url, model="m",
                      response_format=RF, cache="off", progress=False, ordered=True)
    rows = pq.read_table(out).to_pylist()
    assert json.loads(rows[0]["parsed"]) == {"name": "Ada", "age": 36} and rows[0]["parse_error"] is None
    assert rows[1]["parsed"] is None and "not of type 'object'" in rows[1]["parse_error"]


def test_a_pydantic_model_is_sent_as_a_strict_schema(echo):
    pydantic = pytest.importorskip("pydantic")

    class Address(pydantic.BaseModel):
        city: str

    class Person(pydantic.BaseModel):
        name: str
        nick: str | None = None
        home: Address

    carpool.run_batch(['{"name": "Ada", "nick": null, "home": {"city": "London"}}'], endpoint=echo.url,
                      model="m", response_format=Person, cache="off", progress=False)
    body = echo.server.received[-1]["body"]
    rf = body["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["name"] == "Person" and rf["json_schema"]["strict"]
    schema = rf["json_schema"]["schema"]
    assert schema["required"] == ["name", "nick", "home"] and schema["additionalProperties"] is False
    assert schema["$defs"]["Address"]["additionalProperties"] is False
