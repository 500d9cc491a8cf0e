"""The embedded default job: a corpus, a tokenizer and a model that need nothing downloaded.

- Corpus: the documentation topics that ship with Python (``pydoc_data.topics``, English text about the
  language), one document per topic, in sorted order, prose lines only.
- Tokenizer: a byte-level BPE of `DEFAULT_VOCAB_SIZE` tokens trained on that corpus with the
  ``tokenizers`` library (a dependency of transformers), saved as a ``PreTrainedTokenizerFast`` that
  ``AutoTokenizer.from_pretrained`` loads, with the chat template of the embedded chat dataset
  (`automodel_all.cli.chat_data`).
- Model: a small Llama-style ``LlamaConfig`` (about 1.2 M parameters) that trains visibly in minutes
  on two CPU processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel_all.cli.chat_data import CHAT_TEMPLATE

__all__ = ["DEFAULT_VOCAB_SIZE", "EOS_TOKEN", "builtin_corpus", "default_model_config", "train_tokenizer"]

DEFAULT_VOCAB_SIZE = 2048
"""Vocabulary of the default tokenizer and model."""

EOS_TOKEN = "<|endoftext|>"
"""End-of-document token of the default tokenizer (also its BOS and padding token)."""


def _is_prose(line: str) -> bool:
    # The topics hold reST tables and grammar rules ("+-----+", "| ... |", "::="); a model trained on
    # them learns to draw tables. Keep lines that are mostly words.
    visible = [c for c in line if not c.isspace()]
    return bool(visible) and sum(c.isalpha() for c in visible) >= 0.7 * len(visible)


def builtin_corpus() -> list[str]:
    """Documents made from text that ships with Python: the ``pydoc_data`` topics, sorted by name.

    Only prose lines are kept (no tables or grammar rules), with their indentation removed.
    """
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        text = "\n".join(line.strip() for line in topics[name].splitlines() if _is_prose(line))
        if text:
            documents.append(text)
    return documents


def train_tokenizer(documents: list[str], folder: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Train a byte-level BPE tokenizer on ``documents`` and save it to ``folder`` (created).

    Deterministic for the same documents. Returns ``folder``, loadable with
    ``AutoTokenizer.from_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )
    fast.chat_template = CHAT_TEMPLATE  # plain-text roles: adds no token, so the vocabulary is unchanged
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def default_model_config(vocab_size: int = DEFAULT_VOCAB_SIZE, eos_token_id: int = 0) -> Any:
    """The embedded default model: a 4-layer Llama, hidden size 128, 4 heads over 2 key-value heads."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
