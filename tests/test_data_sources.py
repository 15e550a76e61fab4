"""Tokenizer, record sources and record tokenization (CPU, no models)."""

from __future__ import annotations

import json
import logging
import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightning_sloth.data import (
    IGNORE_INDEX,
    SYNTHETIC_TASKS,
    SyntheticTask,
    build_char_tokenizer,
    hf_dataset_records,
    iter_records,
    read_jsonl,
    tokenize_record,
    tokenize_records,
)

PRINTABLE = [chr(c) for c in range(32, 127)] + ["\n"]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(PRINTABLE, k=n))


def targets(ids: list[int], labels: list[int], tokenizer) -> str:
    """Decode the tokens that carry a loss (special tokens kept)."""
    return tokenizer.decode([t for t, y in zip(ids, labels) if y != IGNORE_INDEX])


# --- tokenizer ---------------------------------------------------------------------------------


def test_char_tokenizer_is_deterministic_and_small(tok):
    other = build_char_tokenizer()
    assert other.get_vocab() == tok.get_vocab()
    assert len(tok) == 100
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert sorted(tok.get_vocab().values()) == list(range(100))
    text = random_text(random.Random(0), 200)
    assert tok.encode(text) == other.encode(text)


def test_char_tokenizer_round_trips_text(tok):
    rng = random.Random(1)
    for _ in range(20):
        text = random_text(rng, rng.randint(1, 80))
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_char_tokenizer_maps_unknown_characters_to_unk(tok):
    assert tok.encode("a\tb\u00e9", add_special_tokens=False) == [
        tok.convert_tokens_to_ids("a"),
        tok.unk_token_id,
        tok.convert_tokens_to_ids("b"),
        tok.unk_token_id,
    ]


@pytest.mark.parametrize("loader", [AutoTokenizer, PreTrainedTokenizerFast])
def test_char_tokenizer_save_and_load(tok, tmp_path, loader):
    tok.save_pretrained(tmp_path)
    loaded = loader.from_pretrained(tmp_path)
    text = random_text(random.Random(2), 120)
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(tok.encode(text), skip_special_tokens=True) == text
    assert loaded.chat_template == tok.chat_template
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token, loaded.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )


def test_char_tokenizer_chat_template(tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<s><|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nyo</s>"
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert tok.encode(text, add_special_tokens=False)[-1] == tok.eos_token_id


# --- synthetic task ----------------------------------------------------------------------------


def expected_response(prompt: str) -> str:
    """Solve a synthetic prompt independently of the generator."""
    head, arg = prompt[:-1].split(": ", 1)
    if head == "reverse":
        return arg[::-1]
    if head == "upper":
        return arg.upper()
    if head == "sort":
        return "".join(sorted(arg))
    if head == "copy":
        return arg
    if head.startswith("repeat "):
        return arg * int(head.split()[1])
    if head == "add":
        a, b = arg.split("+")
        return str(int(a) + int(b))
    if head == "next":
        return "".join("abcdefghijklmnopqrstuvwxyza"["abcdefghijklmnopqrstuvwxyz".index(c) + 1] for c in arg)
    if head == "last":
        return arg[-1]
    raise AssertionError(f"unknown prompt {prompt!r}")


def test_synthetic_task_answers_are_determined_by_prompts():
    task = SyntheticTask(600, seed=3, tasks=tuple(SYNTHETIC_TASKS))
    records = list(task)
    assert len(records) == len(task) == 600
    assert {r["task"] for r in records} == set(SYNTHETIC_TASKS)
    for record in records:
        assert record["prompt"].endswith("\n")
        assert 8 <= len(record["prompt"]) <= 34
        assert 1 <= len(record["response"]) <= 26
        assert record["response"] == expected_response(record["prompt"])
    assert len({len(r["prompt"]) for r in records}) > 15  # varied lengths


def test_synthetic_task_is_deterministic_and_seeded():
    a, b = SyntheticTask(200, seed=5), SyntheticTask(200, seed=5)
    assert list(a) == list(b)
    assert a[123] == list(a)[123]
    train, val = SyntheticTask.splits(300, 300, seed=5)
    assert list(train) == list(SyntheticTask(300, seed=5))
    overlap = {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert len(overlap) < 15  # different streams; only tiny prompts (e.g. small sums) can repeat


def test_synthetic_task_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown synthetic tasks \\['divide'\\]"):
        SyntheticTask(10, tasks=("reverse", "divide"))
    with pytest.raises(ValueError, match="num_samples must be >= 0"):
        SyntheticTask(-1)
    with pytest.raises(IndexError, match="out of range"):
        SyntheticTask(3)[3]


# --- files and datasets ------------------------------------------------------------------------


def write_jsonl(path, rows) -> None:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_read_jsonl_prompt_response_and_messages(tmp_path, tok):
    pairs = [{"prompt": f"q{i}: ", "response": f"a{i}"} for i in range(5)]
    chats = [
        {"messages": [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"r{i}"}]}
        for i in range(4)
    ]
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    (tmp_path / "chat.jsonl").write_text(
        "\n".join(json.dumps(r) for r in chats[:2]) + "\n\n  \n" + "\n".join(json.dumps(r) for r in chats[2:])
    )
    assert list(read_jsonl(tmp_path / "pairs.jsonl")) == pairs
    assert list(read_jsonl(str(tmp_path / "chat.jsonl"))) == chats
    samples, skipped = tokenize_records(iter_records(tmp_path / "chat.jsonl"), tok)
    assert skipped == 0 and len(samples) == 4
    assert [targets(ids, labels, tok) for ids, labels in samples] == [f"r{i}</s>" for i in range(4)]


def test_read_jsonl_names_file_and_line_of_invalid_json(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "a", "response": \n')
    reader = read_jsonl(path)
    assert next(reader) == {"prompt": "a", "response": "b"}
    with pytest.raises(ValueError, match=r"broken\.jsonl:3: invalid JSON"):
        next(reader)
    path.write_text('["not", "an", "object"]\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:1: expected a JSON object, got list"):
        list(read_jsonl(path))


def test_hf_dataset_records(tok):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"p{i}", "response": "x" * (i + 1)} for i in range(6)]
    dataset = datasets.Dataset.from_list(rows)
    assert list(hf_dataset_records(dataset)) == rows
    assert list(iter_records(dataset)) == rows
    samples, _ = tokenize_records(iter_records(dataset), tok)
    assert [targets(ids, y, tok) for ids, y in samples] == ["x" * (i + 1) + "</s>" for i in range(6)]
    with pytest.raises(TypeError, match="pick a split"):
        hf_dataset_records(datasets.DatasetDict({"train": dataset}))
    with pytest.raises(TypeError, match="expected a datasets.Dataset, got list"):
        list(hf_dataset_records(rows))


def test_iter_records_rejects_unknown_sources():
    with pytest.raises(TypeError, match="unsupported data source dict"):
        iter_records({"prompt": "a", "response": "b"})


# --- tokenize_record ---------------------------------------------------------------------------


def test_tokenize_prompt_response_exact(tok):
    ids, labels = tokenize_record({"prompt": "ab\n", "response": "C"}, tok, index=0)
    a, b, nl, c = tok.convert_tokens_to_ids(["a", "b", "\n", "C"])
    assert ids == [1, a, b, nl, c, 2]
    assert labels == [IGNORE_INDEX] * 4 + [c, 2]


def test_tokenize_prompt_response_random(tok):
    rng = random.Random(4)
    for index in range(30):
        prompt, response = random_text(rng, rng.randint(0, 40)), random_text(rng, rng.randint(1, 30))
        ids, labels = tokenize_record({"prompt": prompt, "response": response}, tok, index=index)
        assert len(ids) == len(labels) == len(prompt) + len(response) + 2
        assert labels[: len(prompt) + 1] == [IGNORE_INDEX] * (len(prompt) + 1)
        assert labels[len(prompt) + 1 :] == ids[len(prompt) + 1 :]
        assert tok.decode(ids) == f"<s>{prompt}{response}</s>"


def test_tokenize_messages_labels_only_assistant_turns(tok):
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "second"},
    ]
    ids, labels = tokenize_record({"messages": messages}, tok, index=0)
    assert ids == tok.encode(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert targets(ids, labels, tok) == "first</s>second</s>"
    # Each target sits at its own position: labels equal ids there and -100 everywhere else.
    assert sum(y != IGNORE_INDEX for y in labels) == len("first") + len("second") + 2
    assert all(y in (IGNORE_INDEX, t) for t, y in zip(ids, labels))
    assert labels[-1] == tok.eos_token_id and labels[-len("second</s>") - 1] == IGNORE_INDEX


def test_tokenize_messages_without_chat_template(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    plain = AutoTokenizer.from_pretrained(tmp_path)
    plain.chat_template = None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ids, labels = tokenize_record({"messages": messages}, plain, index=0)
    assert plain.decode(ids) == "<s>user: hi\nassistant: yo</s>"
    assert targets(ids, labels, plain) == "yo</s>"


def test_tokenize_messages_rejects_non_incremental_template(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    odd = AutoTokenizer.from_pretrained(tmp_path)
    odd.chat_template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    with pytest.raises(
        ValueError, match="record 9: the chat template does not render conversations incrementally"
    ):
        tokenize_record({"messages": messages}, odd, index=9)


BAD_RECORDS = [
    (["prompt", "response"], "record 7: expected a dict, got list"),
    ({"text": "hello"}, r"record 7: missing 'prompt/response or messages' \(keys: \['text'\]\)"),
    ({"prompt": "a"}, "record 7: missing 'response'"),
    ({"response": "a"}, "record 7: missing 'prompt'"),
    ({"prompt": "a", "response": ""}, "record 7: 'response' is empty"),
    ({"prompt": 3, "response": "a"}, "record 7: 'prompt' must be a string, got int"),
    ({"prompt": "a", "response": ["b"]}, "record 7: 'response' must be a string, got list"),
    (
        {"prompt": "a", "response": "b", "messages": []},
        "record 7: has both 'messages' and 'prompt'/'response'",
    ),
    ({"messages": []}, "record 7: 'messages' must be a non-empty list"),
    ({"messages": "hi"}, "record 7: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "record 7: message 0 needs a string 'content'"),
    ({"messages": [{"content": "x"}]}, "record 7: message 0 needs a string 'role'"),
    (
        {"messages": [{"role": "user", "content": "x"}]},
        "record 7: 'messages' has no non-empty assistant turn",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]},
        "record 7: 'messages' has no non-empty assistant turn",
    ),
]


@pytest.mark.parametrize(("record", "message"), BAD_RECORDS)
def test_tokenize_record_rejects_malformed_records(tok, record, message):
    with pytest.raises(ValueError, match=message):
        tokenize_record(record, tok, index=7)


def test_tokenize_records_policies(tok, caplog):
    records = [
        {"prompt": "a", "response": "b"},
        {"prompt": "a"},
        {"prompt": "c", "response": "d"},
        {"messages": []},
    ]
    with pytest.raises(ValueError, match="record 1: missing 'response'"):
        tokenize_records(records, tok)
    with caplog.at_level(logging.WARNING, logger="lightning_sloth.data.sources"):
        samples, skipped = tokenize_records(records, tok, on_bad_record="skip")
    assert skipped == 2
    assert samples == [tokenize_record(records[0], tok, index=0), tokenize_record(records[2], tok, index=2)]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "skipped 2 of 4 records" in warnings[0] and "record 1: missing 'response'" in warnings[0]
    with pytest.raises(ValueError, match="on_bad_record must be 'error' or 'skip'"):
        tokenize_records(records, tok, on_bad_record="ignore")


def test_config_containers_are_accepted(tok):
    """Hydra passes lists of records as OmegaConf containers."""
    from omegaconf import OmegaConf

    rows = [
        {"prompt": "a", "response": "b"},
        {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "r"}]},
    ]
    samples, _ = tokenize_records(iter_records(OmegaConf.create(rows)), tok)
    assert samples == [tokenize_record(r, tok, index=i) for i, r in enumerate(rows)]


def test_chat_template_errors_name_the_record(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    strict = AutoTokenizer.from_pretrained(tmp_path)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('unsupported role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    messages = [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]
    with pytest.raises(ValueError, match="record 4: the chat template failed: unsupported role tool"):
        tokenize_record({"messages": messages}, strict, index=4)
