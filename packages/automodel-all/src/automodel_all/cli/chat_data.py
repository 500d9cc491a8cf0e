"""The embedded tiny chat dataset (``data.path: builtin:chat``) and the default tokenizer's chat template.

The conversations are generated from a fixed seed, so they need nothing downloaded and are the same on
every machine: short arithmetic, word-order, counting and spelling tasks, some with a system turn, some
with two user/assistant exchanges. A small model learns their format within a few hundred steps, which
is what a fine-tuning test needs to see: the loss on the answers falls, and a held-out split measures it.

The chat template renders turns as plain text (``User: ...``, ``Assistant: ...``) and ends each answer
with the end-of-text token, so it adds no token to the embedded tokenizer's vocabulary. Its
``{% generation %}`` markers tell transformers which characters are the assistant's
(``apply_chat_template(..., return_assistant_tokens_mask=True)``): the loss is computed on those only.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["BUILTIN_CHAT_SPLITS", "CHAT_TEMPLATE", "builtin_chat"]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ 'System: ' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'user' -%}"
    "{{ 'User: ' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ 'Assistant: ' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant: ' }}{%- endif -%}"
)
"""Jinja chat template of the embedded tokenizer (plain-text roles, EOS after each answer)."""

BUILTIN_CHAT_SPLITS: dict[str, tuple[int, int]] = {"train": (2000, 0), "validation": (200, 1)}
"""Split -> (number of conversations, seed offset) of the embedded chat dataset."""

_WORDS = [
    "red",
    "green",
    "blue",
    "black",
    "white",
    "river",
    "stone",
    "cloud",
    "light",
    "night",
    "apple",
    "bread",
    "water",
    "music",
    "table",
    "paper",
    "window",
    "garden",
    "summer",
    "winter",
    "house",
    "mountain",
    "forest",
    "ocean",
    "letter",
    "number",
    "python",
    "string",
    "module",
]
_SYSTEMS = (
    "You are a helpful assistant.",
    "Answer briefly.",
    "You answer questions about words and numbers.",
)
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    if rng.random() < 0.5:
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    hi, lo = max(a, b), min(a, b)
    return f"What is {hi} minus {lo}?", f"{hi} minus {lo} is {hi - lo}."


def _reverse(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(_WORDS, rng.randint(2, 4))
    return f"Reverse the order of these words: {' '.join(words)}", " ".join(reversed(words))


def _count(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(_WORDS, rng.randint(1, 10))
    count = len(words)
    answer = "There is one word." if count == 1 else f"There are {_NUMBER_WORDS[count]} words."
    return f"How many words are in this list: {', '.join(words)}?", answer


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(_WORDS)
    return f"Spell the word {word}.", "-".join(word.upper())


def _first_letter(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(_WORDS)
    return f"What is the first letter of {word}?", f"The first letter of {word} is {word[0]}."


_TASKS = (_arithmetic, _reverse, _count, _spell, _first_letter)


def _conversation(rng: random.Random) -> list[dict[str, str]]:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
    for _ in range(1 if rng.random() < 0.7 else 2):
        question, answer = rng.choice(_TASKS)(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def builtin_chat(split: str = "train") -> list[dict[str, Any]]:
    """The records of one split of the embedded chat dataset: ``{"messages": [{"role", "content"}, ...]}``.

    Raises:
        ValueError: ``split`` is not one of `BUILTIN_CHAT_SPLITS`.
    """
    if split not in BUILTIN_CHAT_SPLITS:
        raise ValueError(
            f"the embedded chat dataset has the splits {sorted(BUILTIN_CHAT_SPLITS)}, not {split!r}"
        )
    count, offset = BUILTIN_CHAT_SPLITS[split]
    rng = random.Random(20_241_119 + offset)
    return [{"messages": _conversation(rng)} for _ in range(count)]
