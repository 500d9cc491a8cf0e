"""Hub ids for the model, its tokenizer and the data, read from a Hugging Face cache and never downloaded.

The test fills a cache of its own in huggingface_hub's layout (``models--acme--tiny`` and
``datasets--acme--corpus``, each a ``refs/main`` and a snapshot) and points ``HF_HUB_CACHE`` at it, with
``HF_HUB_OFFLINE=1``: ``automodel train --model acme/tiny --data acme/corpus`` trains from it, ``automodel
plan`` plans it, and an id the cache lacks is one line naming the option and how to fetch it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(cache: Path, kind: str, repo_id: str, source: Path) -> None:
    """Put ``source``'s files into ``cache`` as the ``main`` snapshot of ``repo_id`` (as a download would)."""
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    shutil.copytree(source, repo / "snapshots" / REVISION)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from automodel_all.cli.default_job import builtin_corpus, default_model_config, train_tokenizer

    root = tmp_path_factory.mktemp("hub")
    documents = builtin_corpus()
    model_dir = train_tokenizer(documents[:200], root / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = default_model_config(len(tokenizer), tokenizer.eos_token_id or 0)
    config.num_hidden_layers = 1
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    data = root / "corpus" / "data"
    data.mkdir(parents=True)
    rows = [json.dumps({"text": doc}) for doc in documents[:64]]
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    cache = root / "cache"
    _cache_repo(cache, "model", "acme/tiny", model_dir)
    _cache_repo(cache, "dataset", "acme/corpus", root / "corpus")
    return cache


def _automodel(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "automodel_all.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=540, check=False)


@pytest.mark.distributed  # a whole train job of 2 workers; the refusals below start none
@pytest.mark.extended
def test_model_tokenizer_and_data_come_from_the_cache(hub_cache: Path, tmp_path: Path) -> None:
    output = tmp_path / "run"
    job = [
        "--model", "acme/tiny", "--data", "acme/corpus", "--steps", "2", "--seq-len", "32",
        "--global-batch-size", "2", "--micro-batch-size", "1", "--nproc-per-node", "2", "--device", "cpu",
        "--set", "train.sample_tokens=0", "--set", "train.plot=false", "--output-dir", str(output),
    ]  # fmt: skip
    result = _automodel(hub_cache, "train", *job)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (output / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    planned = _automodel(hub_cache, "plan", "--model", "acme/tiny", "--world-size", "2", "--device", "cpu")
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "estimated peak memory per rank" in planned.stdout


@pytest.mark.parametrize(
    ("option", "name", "expected"),
    [
        ("--data", "acme/missing", "`hf download acme/missing --repo-type dataset`"),
        ("--model", "acme/missing", "is neither a model folder nor a hub id in the local cache"),
        ("--tokenizer", "acme/missing", "cannot load a tokenizer from 'acme/missing'"),
    ],
)
def test_an_id_the_cache_lacks_is_named_with_how_to_fetch_it(
    hub_cache: Path, tmp_path: Path, option: str, name: str, expected: str
) -> None:
    result = _automodel(
        hub_cache, "train", option, name, "--output-dir", str(tmp_path / "run"), "--device", "cpu"
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("automodel train: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert option in errors[0] and expected in errors[0], errors[0]
