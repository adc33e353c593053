"""Request sets: workload JSONL, random lengths, shared prefixes."""

from __future__ import annotations

import json

import pytest

from carpool.bench.datasets import load_jsonl, random_requests, shared_prefix_requests
from carpool.errors import DatasetError


def test_random_lengths_stay_in_range_and_ignore_eos():
    reqs = random_requests(200, input_len=100, output_len=40, range_ratio=0.25, seed=1)
    ins = [r.prompt_len for r in reqs]
    outs = [r.max_tokens for r in reqs]
    assert min(ins) >= 75 and max(ins) <= 125
    assert min(outs) >= 30 and max(outs) <= 50
    assert len(set(outs)) > 5  # really drawn, not constant
    assert all(r.ignore_eos and r.prompt for r in reqs)
    assert [r.prompt for r in reqs] == [r.prompt for r in random_requests(200, 100, 40, 0.25, seed=1)]


def test_range_ratio_zero_gives_fixed_lengths():
    reqs = random_requests(10, input_len=32, output_len=8)
    assert {r.prompt_len for r in reqs} == {32} and {r.max_tokens for r in reqs} == {8}


def test_random_with_a_tokenizer_counts_real_tokens():
    class Chars:  # one token per character
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    reqs = random_requests(5, input_len=50, output_len=4, tokenizer=Chars())
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert {r.prompt_len for r in reqs} <= {49, 50}  # a trailing space may be stripped


def test_shared_prefix_groups_share_their_prefix():
    reqs = shared_prefix_requests(12, num_prefixes=3, prefix_len=40, suffix_len=10, output_len=5)
    groups = {}
    for r in reqs:
        groups.setdefault(r.request_id.split("-")[0], []).append(r.prompt)
    assert len(groups) == 3
    for prompts in groups.values():
        prefix = " ".join(prompts[0].split()[:40])
        assert all(p.startswith(prefix) for p in prompts)
        assert len(set(prompts)) == len(prompts)  # suffixes differ
    firsts = {" ".join(p[0].split()[:40]) for p in groups.values()}
    assert len(firsts) == 3


def test_load_jsonl_chat_prompt_and_batch_lines(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [
        {"custom_id": "a", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 7},
        {"prompt": "four five", "temperature": 0.5},
        {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3},
        },
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = load_jsonl(path, default_max_tokens=11)
    assert [r.request_id for r in reqs] == ["a", "line-2", "c"]
    assert [r.max_tokens for r in reqs] == [7, 11, 3]
    assert reqs[0].prompt_len == 3 and reqs[1].prompt == "four five"
    assert reqs[1].extra == {"temperature": 0.5}
    assert len(load_jsonl(path, num_prompts=2)) == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"w.jsonl:2: not valid JSON"),
        ('{"max_tokens": 3}', r"w.jsonl:2: needs a 'messages' list or a 'prompt'"),
        ('{"prompt": "x", "max_tokens": 0}', r"w.jsonl:2: 'max_tokens' must be a positive integer"),
        ("[1, 2]", r"w.jsonl:2: expected a JSON object"),
    ],
)
def test_load_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(DatasetError, match=message):
        load_jsonl(path)


def test_missing_file_says_what_to_pass(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_jsonl(tmp_path / "nope.jsonl")
