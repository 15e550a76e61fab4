"""Where records come from, and how one record becomes token ids and labels.

A record is a dict in one of two shapes::

    {"prompt": "reverse: abc\\n", "response": "cba"}
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}

Sources: :class:`SyntheticTask` (built in), :func:`read_jsonl` (a ``.jsonl`` file),
:func:`hf_dataset_records` (a ``datasets.Dataset``) or a plain list of dicts;
:func:`iter_records` accepts any of them. :func:`tokenize_record` turns one record into
``(input_ids, labels)`` with ``labels == -100`` wherever no loss is wanted.
"""

from __future__ import annotations

import json
import logging
import os
import random
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from lightning_sloth.data.batch import IGNORE_INDEX

logger = logging.getLogger(__name__)

Record = dict[str, Any]
Sample = tuple[list[int], list[int]]
BadRecordPolicy = Literal["error", "skip"]

_VAL_SEED_OFFSET = 1_000_003


def _word(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(low, high)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = _word(rng, 3, 16)
    return f"reverse: {word}\n", word[::-1]


def _upper(rng: random.Random) -> tuple[str, str]:
    text = " ".join(_word(rng, 2, 8) for _ in range(rng.randint(1, 3)))
    return f"upper: {text}\n", text.upper()


def _sort(rng: random.Random) -> tuple[str, str]:
    word = _word(rng, 3, 16)
    return f"sort: {word}\n", "".join(sorted(word))


def _copy(rng: random.Random) -> tuple[str, str]:
    word = _word(rng, 3, 24)
    return f"copy: {word}\n", word


def _repeat(rng: random.Random) -> tuple[str, str]:
    times, word = rng.randint(2, 4), _word(rng, 2, 6)
    return f"repeat {times}: {word}\n", word * times


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return f"add: {a}+{b}\n", str(a + b)


def _next(rng: random.Random) -> tuple[str, str]:
    letters = _word(rng, 1, 4)
    return f"next: {letters}\n", "".join(chr(ord(c) + 1) if c != "z" else "a" for c in letters)


def _last(rng: random.Random) -> tuple[str, str]:
    word = _word(rng, 3, 16)
    return f"last: {word}\n", word[-1]


SYNTHETIC_TASKS = {
    "next": _next,
    "last": _last,
    "reverse": _reverse,
    "upper": _upper,
    "sort": _sort,
    "copy": _copy,
    "repeat": _repeat,
    "add": _add,
}


DEFAULT_TASKS = ("reverse", "upper", "sort", "repeat", "add")


class SyntheticTask(Sequence[Record]):
    """A built-in instruction task: short string transformations and small additions.

    Every record is ``{"prompt", "response", "task"}``; the prompt names the task and its
    argument and ends with a newline, the response is fully determined by the prompt::

        reverse: hello\\n  -> olleh        upper: ab cd\\n -> AB CD       sort: dcba\\n -> abcd
        copy: xyz\\n       -> xyz          repeat 3: ab\\n -> ababab      add: 12+345\\n -> 357
        next: abz\\n       -> bca          last: hello\\n -> o

    Prompts are 8 to 34 characters, responses 1 to 26. Record ``i`` depends only on
    ``(seed, i)``, so the task is deterministic and random access is cheap.

    Args:
        num_samples: number of records.
        seed: seed of the record stream; use :meth:`splits` for disjoint train/val streams.
        tasks: which task kinds to mix (uniformly); keys of ``SYNTHETIC_TASKS``.
    """

    def __init__(
        self,
        num_samples: int,
        seed: int = 0,
        tasks: Sequence[str] = DEFAULT_TASKS,
    ) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        unknown = [t for t in tasks if t not in SYNTHETIC_TASKS]
        if unknown or not tasks:
            raise ValueError(
                f"unknown synthetic tasks {unknown or list(tasks)}; choose from {sorted(SYNTHETIC_TASKS)}"
            )
        self.num_samples = num_samples
        self.seed = seed
        self.tasks = tuple(tasks)

    @classmethod
    def splits(
        cls, num_train: int, num_val: int, seed: int = 0, tasks: Sequence[str] | None = None
    ) -> tuple[SyntheticTask, SyntheticTask]:
        """Train and validation tasks drawn from different seeds (``seed`` and ``seed + 1000003``)."""
        kwargs = {} if tasks is None else {"tasks": tasks}
        return cls(num_train, seed, **kwargs), cls(num_val, seed + _VAL_SEED_OFFSET, **kwargs)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Record:  # type: ignore[override]
        if not 0 <= index < self.num_samples:
            raise IndexError(f"SyntheticTask index {index} out of range [0, {self.num_samples})")
        # A string seed is hashed with SHA-512 by `random`, stable across processes and runs.
        rng = random.Random(f"{self.seed}:{index}")
        task = rng.choice(self.tasks)
        prompt, response = SYNTHETIC_TASKS[task](rng)
        return {"prompt": prompt, "response": response, "task": task}

    def __iter__(self) -> Iterator[Record]:
        return (self[i] for i in range(self.num_samples))

    def __repr__(self) -> str:
        return f"SyntheticTask(num_samples={self.num_samples}, seed={self.seed}, tasks={self.tasks})"


def read_jsonl(path: str | os.PathLike) -> Iterator[Record]:
    """Yield one record per non-blank line of a JSON Lines file.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line is not valid JSON or not a JSON object (the message names file and line).
    """
    path = Path(path)
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{line_number}: invalid JSON ({error.msg} at column {error.colno})"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}")
            yield record


def hf_dataset_records(dataset: Any) -> Iterator[Record]:
    """Yield the rows of a ``datasets.Dataset`` as plain dicts (``datasets`` is optional).

    Raises:
        ImportError: ``datasets`` is not installed.
        TypeError: ``dataset`` is not a ``datasets.Dataset`` (a ``DatasetDict`` needs a split chosen).
    """
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            "hf_dataset_records needs the optional `datasets` package: pip install datasets"
        ) from error
    if not isinstance(dataset, datasets.Dataset):
        hint = "; pick a split, e.g. dataset['train']" if isinstance(dataset, datasets.DatasetDict) else ""
        raise TypeError(f"expected a datasets.Dataset, got {type(dataset).__name__}{hint}")
    return (dict(row) for row in dataset)


def iter_records(source: Any) -> Iterable[Record]:
    """Records of any supported source.

    Args:
        source: a :class:`SyntheticTask`, a path to a ``.jsonl`` file, a sequence of record
            mappings (a list of dicts, an OmegaConf ``ListConfig``), or a ``datasets.Dataset``.
    """
    if isinstance(source, str | os.PathLike):
        return read_jsonl(source)
    if isinstance(source, Sequence):  # SyntheticTask, lists, Hydra's ListConfig
        return source
    if type(source).__module__.split(".")[0] == "datasets":
        return hf_dataset_records(source)
    raise TypeError(
        f"unsupported data source {type(source).__name__}: use a SyntheticTask, a .jsonl path, "
        "a list of records or a datasets.Dataset"
    )


def _check_text(record: Record, key: str, index: int, *, allow_empty: bool) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"record {index}: '{key}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value:
        raise ValueError(f"record {index}: '{key}' is empty")
    return value


def _check_messages(record: Record, index: int) -> list[dict[str, str]]:
    messages = record["messages"]
    if isinstance(messages, str) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"record {index}: 'messages' must be a non-empty list of {{role, content}} dicts")
    for turn, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"record {index}: message {turn} needs a string 'role'")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"record {index}: message {turn} needs a string 'content'")
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise ValueError(f"record {index}: 'messages' has no non-empty assistant turn to learn from")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _tokenize_prompt_response(prompt: str, response: str, tokenizer: PreTrainedTokenizerBase) -> Sample:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    response_ids = tokenizer.encode(response, add_special_tokens=False)
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id, *prompt_ids]
    if tokenizer.eos_token_id is not None:
        response_ids = [*response_ids, tokenizer.eos_token_id]
    return prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids


def _render_chat(
    messages: list[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    add_generation_prompt: bool,
    index: int,
) -> str:
    if tokenizer.chat_template:
        try:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except TemplateError as error:
            raise ValueError(f"record {index}: the chat template failed: {error}") from error
    # Plain fallback for tokenizers without a template: "role: content" lines, eos after answers.
    text = tokenizer.bos_token or ""
    for message in messages:
        end = (tokenizer.eos_token or "\n") if message["role"] == "assistant" else "\n"
        text += f"{message['role']}: {message['content']}{end}"
    return text + ("assistant: " if add_generation_prompt else "")


def _tokenize_messages(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, index: int
) -> Sample:
    """Render the whole conversation once; mark assistant turns by rendering prefixes.

    Turn ``i``'s target span is ``[len(render(messages[:i], generation prompt)),
    len(render(messages[:i + 1])))`` in characters: its content plus whatever the template
    closes the turn with (eos). Tokens whose first character lies in a span carry a loss.
    """
    if not tokenizer.is_fast:
        raise TypeError("chat records need a fast tokenizer (offset mappings); got a slow one")
    full = _render_chat(messages, tokenizer, False, index)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = _render_chat(messages[:turn], tokenizer, True, index)
        through = _render_chat(messages[: turn + 1], tokenizer, False, index)
        if not (full.startswith(through) and through.startswith(head)):
            raise ValueError(
                f"record {index}: the chat template does not render conversations incrementally, "
                "so assistant turns cannot be located"
            )
        spans.append((len(head), len(through)))
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    labels = [
        token if any(lo <= begin < hi for lo, hi in spans) else IGNORE_INDEX
        for token, (begin, _) in zip(input_ids, encoding["offset_mapping"])
    ]
    return input_ids, labels


def tokenize_record(record: Record, tokenizer: PreTrainedTokenizerBase, *, index: int) -> Sample:
    """Tokenize one record into ``(input_ids, labels)``, two equal-length lists of ints.

    ``prompt``/``response``: ``bos + prompt + response + eos``, labels ``-100`` on bos and prompt.
    ``messages``: the tokenizer's chat template (or a plain ``role: content`` format when it
    has none), labels only on assistant turns (their content and the template's end-of-turn).

    Args:
        record: a dict with ``prompt`` and ``response`` strings, or a ``messages`` list.
        tokenizer: a Hugging Face tokenizer (a fast one for ``messages``).
        index: the record's position in its source, quoted in errors.

    Raises:
        ValueError: the record is malformed (message names ``index`` and the problem).
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"record {index}: expected a dict, got {type(record).__name__}")
    has_messages, has_pair = "messages" in record, "prompt" in record or "response" in record
    if has_messages and has_pair:
        raise ValueError(f"record {index}: has both 'messages' and 'prompt'/'response'; use one format")
    if has_messages:
        return _tokenize_messages(_check_messages(record, index), tokenizer, index)
    if "prompt" not in record or "response" not in record:
        missing = (
            "response"
            if "prompt" in record
            else "prompt"
            if "response" in record
            else "prompt/response or messages"
        )
        raise ValueError(f"record {index}: missing '{missing}' (keys: {sorted(record)})")
    prompt = _check_text(record, "prompt", index, allow_empty=True)
    response = _check_text(record, "response", index, allow_empty=False)
    return _tokenize_prompt_response(prompt, response, tokenizer)


def tokenize_records(
    records: Iterable[Record], tokenizer: PreTrainedTokenizerBase, *, on_bad_record: BadRecordPolicy = "error"
) -> tuple[list[Sample], int]:
    """Tokenize every record of a source.

    Args:
        records: any iterable of records (see :func:`iter_records`).
        tokenizer: a Hugging Face tokenizer.
        on_bad_record: ``"error"`` raises on the first malformed record; ``"skip"`` drops
            malformed records and logs one warning with their count.

    Returns:
        ``(samples, num_skipped)``: the ``(input_ids, labels)`` pairs in source order.
    """
    if on_bad_record not in ("error", "skip"):
        raise ValueError(f"on_bad_record must be 'error' or 'skip', got {on_bad_record!r}")
    samples: list[Sample] = []
    skipped, first_problem = 0, ""
    for index, record in enumerate(records):
        try:
            samples.append(tokenize_record(record, tokenizer, index=index))
        except ValueError as error:
            if on_bad_record == "error":
                raise
            skipped += 1
            first_problem = first_problem or str(error)
    if skipped:
        logger.warning(
            "skipped %d of %d records that could not be used (first: %s)",
            skipped,
            skipped + len(samples),
            first_problem,
        )
    return samples, skipped
