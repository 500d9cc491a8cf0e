"""Find a Hugging Face checkpoint's weight files: a folder, a single file, or a hub id in the local cache.

Weight formats, in order of preference (as data, `WEIGHT_FILE_PATTERNS`): a sharded safetensors
checkpoint (``model.safetensors.index.json`` plus its files), a single ``model.safetensors``, then the
legacy ``pytorch_model.bin.index.json`` / ``pytorch_model.bin``. A hub id is resolved only through the
local Hugging Face cache (``local_files_only``): this module never touches the network.

Only file-system reads; no collectives.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from automodel_checkpoint.safetensors_io import CorruptCheckpointError

__all__ = [
    "WEIGHT_FILE_PATTERNS",
    "CheckpointFiles",
    "parse_index",
    "resolve_checkpoint",
    "resolve_checkpoint_dir",
]

WeightFormat = Literal["safetensors", "bin"]

WEIGHT_FILE_PATTERNS: tuple[tuple[str, WeightFormat, bool], ...] = (
    ("model.safetensors.index.json", "safetensors", True),
    ("model.safetensors", "safetensors", False),
    ("pytorch_model.bin.index.json", "bin", True),
    ("pytorch_model.bin", "bin", False),
)
"""``(file name, format, is an index)`` in the order they are looked for in a checkpoint folder."""


@dataclass(frozen=True)
class CheckpointFiles:
    """The weight files of one checkpoint.

    Attributes:
        root: The folder.
        format: ``"safetensors"`` or ``"bin"``.
        files: The weight files, in a stable order.
        weight_map: Key -> file, from the index (empty without one: the file headers then say).
        index: The index file, when there is one.
    """

    root: Path
    format: WeightFormat
    files: tuple[Path, ...]
    weight_map: Mapping[str, Path] = field(default_factory=dict)
    index: Path | None = None


def parse_index(index_path: str | os.PathLike[str]) -> dict[str, Path]:
    """Read a ``*.index.json`` and return key -> weight file (resolved next to the index).

    Raises:
        FileNotFoundError: The index or a file it names does not exist (all missing files listed).
        CorruptCheckpointError: The index is not JSON or has no ``weight_map`` object of strings.
    """
    path = Path(index_path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint index {path} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(path, f"it is not valid JSON ({exc})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CorruptCheckpointError(path, "it has no 'weight_map' object mapping keys to file names")
    resolved = {key: path.parent / name for key, name in weight_map.items()}
    missing = sorted({str(f.name) for f in resolved.values() if not f.is_file()})
    if missing:
        raise FileNotFoundError(
            f"checkpoint index {path} names {len(missing)} weight file(s) that do not exist in "
            f"{path.parent}: {missing}. The download or copy is incomplete: fetch the missing shards."
        )
    return resolved


def _from_folder(root: Path) -> CheckpointFiles:
    for name, fmt, is_index in WEIGHT_FILE_PATTERNS:
        candidate = root / name
        if not candidate.is_file():
            continue
        if is_index:
            weight_map = parse_index(candidate)
            files = tuple(sorted(set(weight_map.values())))
            return CheckpointFiles(root, fmt, files, weight_map, candidate)
        return CheckpointFiles(root, fmt, (candidate,))
    # Sharded files without their index: refuse rather than guess which files belong together.
    present = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    looked_for = [name for name, _, _ in WEIGHT_FILE_PATTERNS]
    raise FileNotFoundError(
        f"no weights found in checkpoint folder {root}: looked for {looked_for}; the folder holds "
        f"{present[:20]}{' ...' if len(present) > 20 else ''}. Pass the folder that holds the model's "
        "weight files (a sharded checkpoint needs its *.index.json)."
    )


def resolve_checkpoint_dir(
    path_or_repo_id: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None,
) -> Path:
    """The local folder of a checkpoint: the path itself, or a hub id's snapshot in the HF cache.

    Never downloads: a hub id is looked up with ``huggingface_hub.snapshot_download(...,
    local_files_only=True)``.

    Raises:
        FileNotFoundError: The path does not exist and the id is not in the cache (the message names
            the cache folder it looked in and how to fill it).
    """
    path = Path(path_or_repo_id).expanduser()
    if path.exists():
        return path
    text = str(path_or_repo_id)
    looks_like_id = not text.startswith((".", "/", "~")) and text.count("/") <= 1 and text.strip() != ""
    if not looks_like_id:
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    try:
        snapshot = snapshot_download(text, cache_dir=cache, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError, OSError) as exc:
        raise FileNotFoundError(
            f"{text!r} is not a local folder, and no snapshot of the hub repo {text!r}"
            f"{f' at revision {revision!r}' if revision else ''} is in the Hugging Face cache {cache} "
            f"(looked there only; automodel never downloads). Download it first, e.g. "
            f"`hf download {text}`, or pass cache_dir= / a local folder. ({type(exc).__name__})"
        ) from None
    return Path(snapshot)


def resolve_checkpoint(
    path_or_repo_id: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None,
) -> CheckpointFiles:
    """Find the weight files of a checkpoint folder, weight file or cached hub id.

    A path to a single ``.safetensors`` or ``.bin`` file is that checkpoint alone.

    Raises:
        FileNotFoundError: Nothing found (the message lists what was looked for and where), or an
            index names files that are missing.
        CorruptCheckpointError: An index file is unreadable.
    """
    root = resolve_checkpoint_dir(path_or_repo_id, cache_dir=cache_dir, revision=revision)
    if root.is_file():
        fmt: WeightFormat = "safetensors" if root.suffix == ".safetensors" else "bin"
        return CheckpointFiles(root.parent, fmt, (root,))
    return _from_folder(root)
