"""The folders a job names, checked before anything is loaded: each problem one line naming the option.

transformers reads a model folder without weights or tokenizer files by falling through to other
loaders, and the error a newcomer then meets is about sentencepiece or a hub repo id. Here a folder is
checked for what the job will read from it: ``config.json``, weights (unless ``model.load_weights`` is
false) and tokenizer files (unless ``data.tokenizer`` names another source). A name that is not a
local path is a hub id, resolved later through the local cache (`load_model_config`).
"""

from __future__ import annotations

from pathlib import Path

from automodel_all.cli.config import JobConfig
from automodel_all.cli.yaml_source import ConfigError

__all__ = ["TOKENIZER_FILES", "WEIGHT_PATTERNS", "check_job_folders", "model_folder"]

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
"""The weight files ``from_pretrained`` reads."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
    "tekken.json",
)
"""Files one of which every tokenizer ``AutoTokenizer.from_pretrained`` loads from a folder has."""


def _is_path(value: str) -> bool:
    """Whether ``value`` names a local path rather than a hub id (``namespace/name``)."""
    return value.startswith(("/", ".", "~")) or value.count("/") > 1 or Path(value).exists()


def _folder(where: str, key: str, value: str | None) -> Path | None:
    """The local folder ``value`` names; None for a hub id (or nothing).

    Raises:
        ConfigError: ``value`` is a local path that does not exist, or a file.
    """
    if value is None or not _is_path(value):
        return None
    path = Path(value).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConfigError(f"{where}: {key}={value!r} is a file; give the folder that holds it")
    raise ConfigError(
        f"{where}: {key}={value!r} does not exist; give a folder written by save_pretrained, or a hub id "
        "already in the local Hugging Face cache (docs/cli.md)"
    )


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def model_folder(job: JobConfig) -> Path | None:
    """The local folder ``model.name_or_path`` names (None: the default model, or a hub id).

    Raises:
        ConfigError: The path does not exist, is a file, or has no ``config.json``.
    """
    where = job.raw.where("model", "name_or_path")
    folder = _folder(where, "model.name_or_path", job.model.name_or_path)
    if folder is not None and not (folder / "config.json").is_file():
        raise ConfigError(
            f"{where}: model.name_or_path={job.model.name_or_path!r} has no config.json; give a folder "
            "written by save_pretrained (config.json and the weights)"
        )
    return folder


def _check_model(job: JobConfig) -> None:
    folder = model_folder(job)
    if folder is None:
        return
    where = job.raw.where("model", "name_or_path")
    name = f"model.name_or_path={job.model.name_or_path!r}"
    if job.model.load_weights and not any(next(folder.glob(p), None) for p in WEIGHT_PATTERNS):
        raise ConfigError(
            f"{where}: {name} has a config.json but no weights (*.safetensors, pytorch_model*.bin); give "
            "the folder save_pretrained wrote, or --set model.load_weights=false to start from random weights"
        )
    if job.data.tokenizer is None and not _has_tokenizer(folder):
        raise ConfigError(
            f"{where}: {name} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); give one "
            "with --tokenizer FOLDER (data.tokenizer), or save the tokenizer into the model folder"
        )


def _check_tokenizer(job: JobConfig) -> None:
    where = job.raw.where("data", "tokenizer")
    folder = _folder(where, "data.tokenizer", job.data.tokenizer)
    if folder is not None and not _has_tokenizer(folder):
        raise ConfigError(
            f"{where}: data.tokenizer={job.data.tokenizer!r} has no tokenizer files "
            f"({', '.join(TOKENIZER_FILES[:3])}, ...); give the folder tokenizer.save_pretrained wrote"
        )


def _check_output(job: JobConfig) -> None:
    path = Path(job.train.output_dir)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(
            f"{job.raw.where('train', 'output_dir')}: train.output_dir={job.train.output_dir!r}: {existing} "
            "is a file; give a folder (it is created when missing)"
        )


def check_job_folders(job: JobConfig) -> None:
    """Check the model, tokenizer and output folders of ``job`` (no file is read but directory entries).

    Raises:
        ConfigError: One line naming the option, what is missing and the fix.
    """
    _check_output(job)
    _check_tokenizer(job)
    _check_model(job)
