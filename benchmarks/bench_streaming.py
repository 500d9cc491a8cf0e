"""Streamed training data on a corpus larger than this machine could hold as rows: resident memory per
rank over the run, and the losses after a SIGTERM and a resume on another world size.

The corpus: ``CORPUS_GB`` GB of JSON lines (text records of 2-6 KB cut from the text that ships with
Python, each numbered), generated once into a scratch folder. As prepared rows it would be about
``12 x tokens`` bytes per rank, more than the machine has; streamed, a rank holds a block of records per
row slot.

1. **Training**: ``automodel train --streaming`` (2 gloo workers, the embedded default model with one
   layer, ``seq_len`` 512, global batch 8: 4 slots per rank) for ``STEPS`` steps, uninterrupted. A
   thread samples every worker's resident memory (``VmRSS``) with the step it was at; the figure is
   the worst worker's RSS over the last quarter of the steps against the same over the second quarter
   (flat: 1.0).
2. **Resume**: the same job, SIGTERM to the launcher once step ``STOP_AT`` is logged (the workers save
   a checkpoint holding the 8 stream cursors and exit), then ``--resume`` on ONE worker to the end: the
   largest loss difference to the uninterrupted run over every step.
3. **A whole pass**: one process streams one of 64 slots through the entire corpus (it parses all of
   it and tokenizes 1/64 of it, as rank 0 of 64 data-parallel ranks would), sampling its RSS at every
   tenth of the corpus: RSS at the end of the pass against RSS after the first tenth.

    uv run --all-packages python benchmarks/bench_streaming.py [--gb 4.2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CORPUS_GB = 4.2
STEPS = 40
STOP_AT = 15
SLOTS = 8
PASS_SLOTS = 64
JOB = [
    "--steps", str(STEPS), "--checkpoint-every", "100", "--seq-len", "512", "--global-batch-size", str(SLOTS),
    "--micro-batch-size", "2", "--warmup-steps", "2", "--lr", "0.003", "--device", "cpu", "--streaming",
    "--set", "train.keep_checkpoints=0", "--set", "train.sample_tokens=0", "--set", "train.plot=false",
    "--set", "model.config_overrides={num_hidden_layers: 1}",
]  # fmt: skip
MiB = 2**20


def write_corpus(folder: Path, gigabytes: float) -> Path:
    """JSON lines of numbered text records, ``gigabytes`` GB in all (deterministic)."""
    from automodel_all.cli.default_job import builtin_corpus

    text = " ".join(builtin_corpus())
    path = folder / "train.jsonl"
    target = int(gigabytes * 1e9)
    written, number = 0, 0
    with path.open("w") as out:
        while written < target:
            start = (number * 7919) % (len(text) - 8192)
            length = 2048 + (number * 104729) % 4096
            line = json.dumps({"text": f"Record {number}. {text[start : start + length]}"}) + "\n"
            out.write(line)
            written += len(line)
            number += 1
    return path


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _workers(launcher: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher and b"automodel_all.cli.train" in command:
            found.append(int(entry.name))
    return found


def _losses(output: Path) -> dict[int, float]:
    path = output / "train_log.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def _job(output: Path, data: Path, *extra: str, stop_at: int | None = None) -> list[tuple[int, int]]:
    """Run one job; return ``(step, worst worker RSS)`` samples. SIGTERM once ``stop_at`` is logged."""
    command = [sys.executable, "-m", "automodel_all.cli", "train", *JOB, "--data", str(data)]
    command += ["--output-dir", str(output), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples: list[tuple[int, int]] = []

    def watch() -> None:
        while process.poll() is None:
            step = max(_losses(output), default=0)
            sizes = [size for pid in _workers(process.pid) if (size := _rss(pid)) is not None]
            if sizes and step:
                samples.append((step, max(sizes)))
            if stop_at is not None and step >= stop_at:
                process.send_signal(signal.SIGTERM)
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, _ = process.communicate(timeout=3600)
    watcher.join(timeout=5)
    if process.returncode != 0:
        raise RuntimeError(f"automodel train failed:\n{out[-4000:]}")
    return samples


def _quarter(samples: list[tuple[int, int]], first: float, last: float) -> int:
    chosen = [rss for step, rss in samples if first * STEPS < step <= last * STEPS]
    return max(chosen) if chosen else 0


def whole_pass(data: Path, scratch: Path) -> list[tuple[float, int]]:
    """Stream slot 0 of `PASS_SLOTS` through the whole corpus; ``(fraction read, RSS)`` at each tenth."""
    from transformers import AutoTokenizer

    from automodel_all.cli.encode import RecordKeys
    from automodel_all.cli.streaming import StreamingRows, StreamSpec

    tokenizer = AutoTokenizer.from_pretrained(scratch / "reference" / "tokenizer")
    keys = RecordKeys("text", "prompt", "completion", "messages")
    spec = StreamSpec(str(data), "train", scratch / "cache", "text", "concat", 512, keys, 0, PASS_SLOTS)
    rows = StreamingRows(spec, tokenizer, range(1))
    records = _record_count(data)
    samples: list[tuple[float, int]] = []
    mark = 0.1
    while True:  # until the slot's cursor starts its second pass
        rows.next_rows()
        cursor = rows.cursors()[0]
        fraction = 1.0 if cursor.passes else cursor.record / records
        if fraction >= mark:
            samples.append((fraction, _rss(os.getpid()) or 0))
            mark += 0.1
        if cursor.passes:
            return samples


def _record_count(path: Path) -> int:
    count = 0
    with path.open("rb") as lines:
        for block in iter(lambda: lines.read(1 << 24), b""):
            count += block.count(b"\n")
    return count


def measure(gigabytes: float = CORPUS_GB) -> dict[str, Any]:
    """Run the three parts; return their figures (see the module docstring)."""
    scratch = Path(tempfile.mkdtemp(prefix="bench_streaming_"))
    try:
        folder = scratch / "data"
        folder.mkdir()
        began = time.perf_counter()
        corpus = write_corpus(folder, gigabytes)
        written_s = time.perf_counter() - began
        samples = _job(scratch / "reference", folder, "--nproc-per-node", "2")
        expected = _losses(scratch / "reference")
        _job(scratch / "run", folder, "--nproc-per-node", "2", stop_at=STOP_AT)
        stopped = max(_losses(scratch / "run"))
        _job(scratch / "run", folder, "--nproc-per-node", "1", "--resume")
        resumed = _losses(scratch / "run")
        difference = max(abs(resumed[step] - expected[step]) for step in expected)
        began = time.perf_counter()
        passed = whole_pass(corpus, scratch)
        return {
            "corpus_bytes": corpus.stat().st_size,
            "records": _record_count(corpus),
            "write_s": written_s,
            "rss_second_quarter": _quarter(samples, 0.25, 0.5),
            "rss_last_quarter": _quarter(samples, 0.75, 1.0),
            "stopped_at": stopped,
            "max_loss_difference": difference,
            "steps_compared": len(expected),
            "last_loss": (resumed[STEPS], expected[STEPS]),
            "pass_rss": passed,
            "pass_s": time.perf_counter() - began,
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gb", type=float, default=CORPUS_GB, help="corpus size in GB")
    figures = measure(parser.parse_args().gb)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
