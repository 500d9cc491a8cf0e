"""Records -> token documents with a loss mask: plain text, prompt/completion, or chat ``messages``.

- ``text``: the record's text, tokenized (with the tokenizer's special tokens), then EOS; every token
  is a target.
- ``prompt_completion``: the prompt tokenized with the tokenizer's special tokens, then the completion
  and EOS; only the completion and EOS are targets. A conversational pair (``prompt`` and ``completion``
  each a list of messages) is treated as the conversation ``prompt + completion``.
- ``messages``: the conversation rendered with the tokenizer's chat template; only the assistant's
  tokens are targets. When the template marks them (``{% generation %}``), transformers finds them
  (``apply_chat_template(return_assistant_tokens_mask=True)``); otherwise each assistant turn's text is
  located by rendering the conversation up to that turn (with and without it) and the tokens whose
  characters fall inside are the targets. A template that renders earlier turns differently once later
  ones exist defeats that and is refused, naming the record. That way also counts what the template
  renders after the answer within the turn (a newline after the end-of-turn token, say) as the
  assistant's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FORMATS", "Document", "RecordKeys", "encode_records", "resolve_format"]

FORMATS = ("text", "prompt_completion", "messages", "image_messages")
"""Record formats ``data.format`` may name (besides ``auto``)."""

_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass(frozen=True)
class Document:
    """One record as tokens.

    Attributes:
        ids: Token ids.
        targets: ``targets[j]``: token ``j`` is predicted by the loss (from the tokens before it). A
            document's first token has no predecessor of its own: it is predicted only in a stream of
            concatenated documents (``data.packing: concat``), where the previous document precedes it.
    """

    ids: list[int]
    targets: list[bool]

    def __post_init__(self) -> None:
        assert len(self.ids) == len(self.targets)


@dataclass(frozen=True)
class RecordKeys:
    """The record fields of each format (``data.text_key`` and friends)."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"


def resolve_format(fmt: str, columns: Iterable[str], keys: RecordKeys, where: str) -> str:
    """The record format: ``fmt`` itself, or for ``auto`` the one the columns show.

    ``auto`` picks ``messages`` when the records have ``keys.messages``, then ``prompt_completion`` when
    they have both ``keys.prompt`` and ``keys.completion``, then ``text`` for ``keys.text``.

    Raises:
        ValueError: No format fits the columns, or ``fmt`` needs columns the records lack.
    """
    names = set(columns)
    needs = {
        "messages": [keys.messages],
        "prompt_completion": [keys.prompt, keys.completion],
        "text": [keys.text],
    }
    if fmt == "auto":
        for candidate in ("messages", "prompt_completion", "text"):
            if all(k in names for k in needs[candidate]):
                return candidate
        raise ValueError(
            f"{where}: the records have the fields {sorted(names)}; none of data.messages_key="
            f"{keys.messages!r}, data.prompt_key/completion_key=({keys.prompt!r}, {keys.completion!r}) or "
            f"data.text_key={keys.text!r} is among them; set the key that names your field"
        )
    needs["image_messages"] = needs["messages"]
    missing = [k for k in needs[fmt] if k not in names]
    if missing:
        raise ValueError(
            f"{where}: data.format={fmt} needs the field(s) {missing}; the records have {sorted(names)}"
        )
    return fmt


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, Mapping) for m in value)


def _check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not _is_conversation(messages) or not messages:
        raise ValueError(
            f"{where}: expected a non-empty list of {{role, content}} messages, got {messages!r:.80}"
        )
    out = []
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(
                f"{where}: message {index} needs string 'role' and 'content', got {dict(message)!r:.80}"
            )
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: the conversation has no assistant message, so nothing to learn from")
    return out


def _text(tokenizer: Any, texts: Sequence[str]) -> list[Document]:
    eos = tokenizer.eos_token_id
    docs = []
    for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]:
        full = [*ids, eos] if eos is not None else list(ids)
        docs.append(Document(full, [True] * len(full)))
    return docs


def _prompt_completion(tokenizer: Any, prompts: Sequence[str], completions: Sequence[str]) -> list[Document]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("data.format=prompt_completion needs a tokenizer with an EOS token (to end answers)")
    prompt_ids = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    completion_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    docs = []
    for p, c in zip(prompt_ids, completion_ids, strict=True):
        docs.append(Document([*p, *c, eos], [False] * len(p) + [True] * (len(c) + 1)))
    return docs


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert isinstance(text, str)
    return text


def _assistant_spans(
    tokenizer: Any, messages: list[dict[str, str]], where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the assistant turns (prefix rendering)."""
    full = _render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], generation_prompt=True) if index else ""
        upto = _render(tokenizer, messages[: index + 1])
        if not (full.startswith(upto) and upto.startswith(before)):
            raise ValueError(
                f"{where}: the tokenizer's chat template renders earlier turns differently once later turns "
                "are added, so the assistant's tokens cannot be located; use a template with "
                "{% generation %} markers (data.tokenizer) or data.format=prompt_completion"
            )
        spans.append((len(before), len(upto)))
    return full, spans


def _messages(
    tokenizer: Any, conversations: Sequence[list[dict[str, str]]], wheres: Sequence[str]
) -> list[Document]:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            f"data.format=messages needs a tokenizer with a chat template; {type(tokenizer).__name__} "
            f"({getattr(tokenizer, 'name_or_path', '?')}) has none: set data.tokenizer to one that has"
        )
    docs = []
    if isinstance(template, str) and _GENERATION.search(template):
        for messages in conversations:
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = list(out["input_ids"])
            docs.append(Document(ids, [bool(m) for m in out["assistant_masks"]]))
        return docs
    rendered = [_assistant_spans(tokenizer, m, w) for m, w in zip(conversations, wheres, strict=True)]
    encoded = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    for (_, spans), ids, offsets in zip(
        rendered, encoded["input_ids"], encoded["offset_mapping"], strict=True
    ):
        # A token is the assistant's when it holds any of the turn's characters (transformers' rule for
        # generation blocks, `char_to_token` of the span's ends).
        targets = [any(start < hi and end > lo for lo, hi in spans) for start, end in offsets]
        docs.append(Document(list(ids), targets))
    return docs


def encode_records(
    records: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    *,
    fmt: str,
    keys: RecordKeys,
    where: str,
    first_index: int = 0,
) -> list[Document]:
    """Tokenize every record of format ``fmt`` (already resolved by `resolve_format`).

    Args:
        records: The records, in order.
        tokenizer: A transformers tokenizer (a fast one for ``messages`` without generation markers).
        fmt: One of `FORMATS`.
        keys: The field names.
        where: Names the source in messages (``data.path /x/y.jsonl``); record ``i`` is ``where[i]``.
        first_index: The number messages give the first record (a streamed record's place in its source).

    Raises:
        ValueError: A record that does not fit the format (naming its index), or a tokenizer that lacks
            what the format needs.
    """
    rows = list(records)
    if fmt == "text":
        texts = []
        for index, record in enumerate(rows, first_index):
            value = record.get(keys.text)
            if not isinstance(value, str):
                raise ValueError(
                    f"{where} record {index}: field {keys.text!r} is not a string (data.text_key)"
                )
            if value.strip():
                texts.append(value)
        return _text(tokenizer, texts) if texts else []
    if fmt == "prompt_completion":
        prompts, completions, conversations, wheres = [], [], [], []
        for index, record in enumerate(rows, first_index):
            prompt, completion = record.get(keys.prompt), record.get(keys.completion)
            label = f"{where} record {index}"
            if isinstance(prompt, list) and isinstance(completion, list):
                conversations.append(_check_messages(prompt + completion, label))
                wheres.append(label)
            elif isinstance(prompt, str) and isinstance(completion, str):
                prompts.append(prompt)
                completions.append(completion)
            else:
                raise ValueError(
                    f"{label}: fields {keys.prompt!r} and {keys.completion!r} must both be strings or both "
                    "lists of messages"
                )
        docs = _prompt_completion(tokenizer, prompts, completions) if prompts else []
        return docs + (_messages(tokenizer, conversations, wheres) if conversations else [])
    assert fmt == "messages", fmt
    wheres = [f"{where} record {index}" for index in range(first_index, first_index + len(rows))]
    conversations = [_check_messages(r.get(keys.messages), w) for r, w in zip(rows, wheres, strict=True)]
    return _messages(tokenizer, conversations, wheres)
