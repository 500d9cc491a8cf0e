"""Where records come from: the embedded corpora, or local files read through Hugging Face ``datasets``.

``data.path`` may be:

- ``null`` or ``builtin:text``: the documentation topics that ship with Python (one record per topic);
- ``builtin:chat``: the embedded chat dataset (splits ``train`` and ``validation``);
- ``builtin:image_chat``: the embedded conversations about pictures (`automodel_all.cli.image_data`),
  written as a folder of images with ``train.jsonl`` and ``validation.jsonl`` under the job's data
  folder, then read like any such folder;
- a file: ``.json`` / ``.jsonl`` (the ``json`` builder), ``.parquet``, ``.csv``, ``.arrow``, or
  ``.txt`` / ``.md`` (the ``text`` builder, one record per file);
- a folder of such files, read recursively; ``datasets`` infers splits from the file names
  (``train.jsonl``, ``validation.jsonl``, ``test-*.parquet``, ...), everything else is ``train``;
- a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.

Records are plain dicts. ``datasets`` keeps its Arrow cache under the job's output folder
(``<output_dir>/data/cache``), never in the home directory, so runs do not share state by accident.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "BUILTIN_SOURCES",
    "FILE_BUILDERS",
    "check_source",
    "hub_dataset_snapshot",
    "image_root",
    "is_hub_id",
    "read_records",
    "stream_records",
]

BUILTIN_SOURCES = ("builtin:text", "builtin:chat", "builtin:image_chat")
"""Names of the embedded data sources."""

FILE_BUILDERS: dict[str, str] = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
    ".txt": "text",
    ".md": "text",
}
"""File suffix -> ``datasets`` packaged builder."""

_SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes at the top of its folder


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in FILE_BUILDERS)


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a hub repo id (``namespace/name``) rather than a local path."""
    if name.startswith(("/", ".", "~", "builtin:")) or Path(name).exists():
        return False
    namespace, _, repo = name.partition("/")
    return bool(namespace) and bool(repo) and "/" not in repo


def hub_dataset_snapshot(name: str) -> Path:
    """The local snapshot of the dataset repo ``name`` in the Hugging Face cache (never downloads).

    The cache is huggingface_hub's (``HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``); the folder
    is then read like any local data folder.

    Raises:
        FileNotFoundError: No snapshot of ``name`` is in the cache; the message says how to fetch one.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, repo_type="dataset", local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        raise FileNotFoundError(
            f"{name!r} is neither a local path nor a dataset in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} (automodel never downloads); fetch it first with "
            f"`hf download {name} --repo-type dataset`"
        ) from None


def check_source(path: str | None) -> None:
    """Check ``data.path`` (or ``data.eval_path``) without reading it.

    Raises:
        FileNotFoundError: The path does not exist.
        ValueError: An unknown ``builtin:`` name, an unsupported file type, or a folder with no data file.
    """
    if path is None or path in BUILTIN_SOURCES:
        return
    if path.startswith("builtin:"):
        raise ValueError(f"{path!r} is not an embedded data source; choose one of {list(BUILTIN_SOURCES)}")
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    if root.is_file() and root.suffix not in FILE_BUILDERS:
        raise ValueError(f"{root}: unsupported file type {root.suffix!r}; use one of {sorted(FILE_BUILDERS)}")
    if root.is_dir() and not any((root / m).is_file() for m in _SAVED_MARKERS) and not _files(root):
        raise ValueError(
            f"{root} holds no {', '.join(sorted(FILE_BUILDERS))} file and is not a save_to_disk folder"
        )


def _split_of(found: Any, split: str, where: str) -> Any:
    """``found[split]`` of a DatasetDict (a plain Dataset is its own ``train`` split)."""
    from datasets import DatasetDict, IterableDatasetDict

    if not isinstance(found, DatasetDict | IterableDatasetDict):
        if split != "train":
            raise ValueError(f"{where} has a single split (train); split {split!r} does not exist")
        return found
    if split not in found:
        raise ValueError(f"{where} has the splits {sorted(found)}, not {split!r}")
    return found[split]


def _load_files(root: Path, split: str, cache_dir: Path, streaming: bool) -> Iterable[dict[str, Any]]:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if root.is_dir() and any((root / m).is_file() for m in _SAVED_MARKERS):
        saved = _split_of(datasets.load_from_disk(str(root)), split, str(root))
        return saved.to_iterable_dataset() if streaming else saved  # memory-mapped Arrow either way
    files = [root] if root.is_file() else _files(root)
    builders = sorted({FILE_BUILDERS[f.suffix] for f in files})
    parts = []
    for builder in builders:
        options: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
        options.update(cache_dir=str(cache_dir), streaming=streaming)
        if root.is_dir():  # datasets infers the splits from the file names
            found = datasets.load_dataset(builder, data_dir=str(root), **options)
        else:
            found = datasets.load_dataset(builder, data_files={"train": [str(root)]}, **options)
        parts.append(_split_of(found, split, str(root)))
    if len(parts) == 1:
        return parts[0]
    return datasets.concatenate_datasets(parts) if streaming else _chain(parts)


def _chain(parts: list[Iterable[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    for part in parts:
        yield from part


def image_root(path: str | None, cache_dir: Path) -> Path:
    """The folder that relative image paths of ``path``'s records are resolved against.

    The folder itself, the file's folder, or (``builtin:image_chat``) where the embedded example is
    written, beside the cache.
    """
    if path == "builtin:image_chat":
        return cache_dir.parent / "image_chat"
    root = Path(path or ".")
    return root if root.is_dir() else root.parent


def read_records(
    path: str | None, split: str, cache_dir: Path, *, streaming: bool = False
) -> Iterable[dict[str, Any]]:
    """The records of ``split`` of the source ``path`` (see the module docstring).

    With ``streaming``, files and ``save_to_disk`` folders come as a ``datasets.IterableDataset`` that
    reads them lazily (`stream_records`); the embedded sources are small lists either way.

    Raises:
        FileNotFoundError: The path does not exist.
        ValueError: An unknown source or split, or a file ``datasets`` cannot read (the message names it).
    """
    check_source(path)
    if path is None or path == "builtin:text":
        if split != "train":
            raise ValueError(f"the embedded text corpus has a single split (train), not {split!r}")
        from automodel_all.cli.default_job import builtin_corpus

        return [{"text": doc} for doc in builtin_corpus()]
    if path == "builtin:chat":
        from automodel_all.cli.chat_data import builtin_chat

        return builtin_chat(split)
    root = Path(path)
    if path == "builtin:image_chat":
        from automodel_all.cli.image_data import IMAGE_CHAT_SPLITS, write_image_chat_example

        if split not in IMAGE_CHAT_SPLITS:
            raise ValueError(
                f"the embedded image chat example has the splits {sorted(IMAGE_CHAT_SPLITS)}, not {split!r}"
            )
        root = write_image_chat_example(image_root(path, cache_dir)) / f"{split}.jsonl"
        split = "train"
    try:
        return _load_files(root, split, cache_dir, streaming)
    except ValueError:
        raise
    except Exception as exc:  # datasets raises its own types (DatasetGenerationError, ArrowInvalid, ...)
        raise ValueError(f"{root}: datasets could not read it ({type(exc).__name__}: {exc})") from None


def stream_records(path: str | None, split: str, cache_dir: Path) -> Any:
    """The records of ``split`` of ``path`` as a ``datasets.IterableDataset`` (``data.streaming``).

    Files are read lazily, in their order, a block at a time; nothing is cached on disk.

    Raises:
        FileNotFoundError: The path does not exist.
        ValueError: An unknown source or split, or a file ``datasets`` cannot read.
    """
    import datasets

    records = read_records(path, split, cache_dir, streaming=True)
    if isinstance(records, datasets.IterableDataset):
        return records
    return datasets.Dataset.from_list(list(records)).to_iterable_dataset()  # an embedded source
