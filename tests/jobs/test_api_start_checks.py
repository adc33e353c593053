"""The Python API makes the start-up check ``carpool run`` makes: a mistake in the call
stops it with ``StartRefused`` (naming the fix) before any request is sent, instead of
coming back as an error in every row or as a job that waits on an outage.

Against the fault server, a real HTTP server on 127.0.0.1 that counts the task requests
it receives (``total_requests``; the start's ``GET /models`` is not one of them).
"""

import asyncio

import pytest

import carpool
from carpool.errors import StartRefused
from carpool.testing.fault_server import FaultConfig
from carpool.testing.fixtures import free_port

pd = pytest.importorskip("pandas")

REVIEWS = pd.DataFrame({"review": ["great phone", "broke in a week", "fine"], "stars": [5, 1, 3]})


@pytest.fixture
def server(fault_server):
    return fault_server(FaultConfig(models=["m"], echo=True))


def test_a_template_column_that_is_not_there_is_refused_before_any_request(server):
    with pytest.raises(StartRefused, match=r"'reviw' is not in .*did you mean \{review\}"):
        carpool.run_batch(REVIEWS, endpoint=server.url, model="m", template="Classify: {reviw}", cache="off",
                          progress=False)
    assert server.server.total_requests == 0
    # The same call spelt right runs: the check refuses the typo, not the template.
    out = carpool.run_batch(REVIEWS, endpoint=server.url, model="m", template="Classify: {review}", cache="off",
                            progress=False)
    assert list(out["content"]) == ["Classify: great phone", "Classify: broke in a week", "Classify: fine"]


def test_a_template_over_a_list_of_dicts_is_checked_against_their_keys(server):
    rows = [{"review": "good"}, {"review": "bad"}]
    with pytest.raises(StartRefused, match="'text' is not in"):
        carpool.run_batch(rows, endpoint=server.url, model="m", template="Say: {text}", cache="off", progress=False)
    assert server.server.total_requests == 0


@pytest.mark.parametrize(("shape", "fix"), [
    ("no-v1", "lacks /v1"),
    ("no-scheme", "write http://127.0.0.1:"),
    ("typo-scheme", "write http://127.0.0.1:"),
    ("route", "names a route"),
])
def test_an_endpoint_of_the_wrong_shape_is_refused_with_the_fix(server, shape, fix):
    host = server.url.removeprefix("http://").removesuffix("/v1")
    url = {"no-v1": f"http://{host}", "no-scheme": f"{host}/v1", "typo-scheme": f"htp://{host}/v1",
           "route": f"http://{host}/v1/chat/completions"}[shape]
    with pytest.raises(StartRefused, match=fix):
        carpool.run_batch(["hello"], endpoint=url, model="m", max_tokens=4, cache="off", progress=False)
    assert server.server.total_requests == 0


def test_messages_name_run_batch_s_arguments_not_the_command_line_s_flags(server):
    # Before: "pass --endpoint ...", a flag a Python caller has no use for.
    bare = server.url.removesuffix("/v1")
    with pytest.raises(StartRefused, match="lacks /v1") as refused:
        carpool.run_batch(["hello"], endpoint=bare, model="m", max_tokens=4, cache="off", progress=False)
    assert f"pass endpoint='{bare}/v1'" in str(refused.value) and "--" not in str(refused.value)
    with pytest.raises(StartRefused, match="is not served") as refused:
        carpool.run_batch(["hello"], endpoint=server.url, model="n", max_tokens=4, cache="off", progress=False)
    assert "model='n'" in str(refused.value) and "--" not in str(refused.value)
    with pytest.raises(StartRefused, match="nothing answers") as refused:
        carpool.run_batch(["hello"], endpoint=f"http://127.0.0.1:{free_port()}/v1", model="m", max_tokens=4,
                          cache="off", progress=False)
    assert "wait_for_endpoint=" in str(refused.value) and "--" not in str(refused.value)
    assert server.server.total_requests == 0


def test_a_resume_with_other_settings_names_run_batch_s_arguments(server, tmp_path):
    # The journal's refusal offered "--force" and "--fresh" to a Python caller.
    out = tmp_path / "out.jsonl"
    carpool.run_batch(["hello"], out, endpoint=server.url, model="m", max_tokens=4, cache="off", progress=False)
    with pytest.raises(StartRefused, match="another setup") as refused:
        carpool.run_batch(["hello"], out, endpoint=server.url, model="m", max_tokens=8, cache="off", progress=False)
    message = str(refused.value)
    assert "force=True" in message and "fresh=True" in message and "--" not in message


def test_a_broken_price_file_is_named_as_run_batch_s_argument(server, tmp_path):
    prices = tmp_path / "prices.json"
    prices.write_text("{not json")
    with pytest.raises(StartRefused, match="not valid JSON") as refused:
        carpool.run_batch(["hello"], endpoint=server.url, model="m", max_tokens=4, cache="off", progress=False,
                          prices=str(prices))
    assert f"prices='{prices}'" in str(refused.value) and "--" not in str(refused.value)
    assert server.server.total_requests == 0


def test_a_table_without_template_and_without_a_prompt_column_is_refused(server):
    # Before: a bad line per row, returned as errors.
    with pytest.raises(StartRefused, match=r"no prompt, messages or input column in the rows "
                                           r"\(its columns: review, stars\)") as refused:
        carpool.run_batch(REVIEWS, endpoint=server.url, model="m", max_tokens=4, cache="off", progress=False)
    assert "template='Classify: {review}'" in str(refused.value) and "--" not in str(refused.value)
    assert server.server.total_requests == 0


def test_a_port_where_nothing_listens_is_refused_at_once_not_waited_on():
    # Before: the job paused as if the endpoint were down (--outage-timeout, 15 minutes).
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(StartRefused, match=f"nothing answers at {url}"):
        carpool.run_batch(["hello"], endpoint=url, model="m", max_tokens=4, cache="off", progress=False)


@pytest.mark.parametrize(("option", "value"), [
    ("max_tokens", -5), ("max_tokens", 0), ("max_tokens", 2.5), ("temperature", -1.0), ("concurrency", 0),
    ("rpm", -10), ("max_pending", 0),
])
def test_a_setting_the_command_line_would_refuse_is_refused(server, option, value):
    with pytest.raises(StartRefused, match=f"{option} {value!r}"):
        carpool.run_batch(["hello"], endpoint=server.url, model="m", cache="off", progress=False,
                          **{"max_tokens": 4, option: value})
    assert server.server.total_requests == 0


def test_a_misspelt_task_key_is_refused_with_the_close_match(server):
    tasks = [{"messages": [{"role": "user", "content": "hi"}], "max_token": 4}]
    with pytest.raises(StartRefused, match="did you mean max_tokens"):
        carpool.run_batch(tasks, endpoint=server.url, model="m", cache="off", progress=False)
    assert server.server.total_requests == 0


def test_arun_batch_and_the_dry_run_make_the_same_check(server):
    with pytest.raises(StartRefused, match="'reviw' is not in"):
        asyncio.run(carpool.arun_batch(REVIEWS, endpoint=server.url, model="m", template="Classify: {reviw}",
                                       cache="off", progress=False))
    with pytest.raises(StartRefused, match="'reviw' is not in"):
        carpool.run_batch(REVIEWS, endpoint=server.url, model="m", template="Classify: {reviw}", dry_run=True)
    assert server.server.total_requests == 0


def test_a_result_column_in_the_input_is_a_refused_start(server):
    frame = pd.DataFrame({"prompt": ["a"], "content": ["clash"]})
    with pytest.raises(StartRefused, match="'content' is also a result column"):
        carpool.run_batch(frame, endpoint=server.url, model="m", max_tokens=4, cache="off", progress=False)
    assert server.server.total_requests == 0
