"""Our safetensors slice reader against ``safetensors.safe_open(...).get_slice`` and torch's DCP reader.

The question: does `automodel_checkpoint` need its own header parser and ``preadv`` reader
(``safetensors_io.py`` + ``reader.py``), or would the library readers do? Each of 4 gloo ranks reads its
FSDP shard (rows ``r/4 .. (r+1)/4`` of dim 0, as ``Shard(0)`` cuts them) of every tensor of one
checkpoint into preallocated tensors, three ways, in the same run:

- ``ours``: `open_checkpoint` (every header validated) + `CheckpointReader.read` (``os.preadv`` of the
  slice's bytes straight into the destination);
- ``safe_open``: ``safetensors.safe_open(path, "pt").get_slice(key)[rows]`` copied into the destination
  (memory-mapped);
- ``dcp-hf``: ``torch.distributed.checkpoint.load`` of a ``Shard(0)`` DTensor state dict with
  ``HuggingFaceStorageReader`` (DCP plans the reads collectively, then reads with ``get_slice``).

Two checkpoints, written once into a temporary folder (random fp32 values, transformers' key layout) and
deleted afterwards: the 124.7M Llama of ``bench_checkpoint_load.py`` (hidden 768, 12 layers, 12 heads /
4 key-value heads, vocab 32000, untied: 476 MiB) and a Llama-3.2-1B shape (hidden 2048, 16 layers, 32
heads / 8 key-value heads, intermediate 8192, vocab 128256, tied: 1.24B parameters, 4.6 GiB). The page
cache is warmed by one full read before the first reader runs, so every reader reads from memory.

Per rank, fastest of ``--repeats`` reads: wall time, and peak memory growth (``VmHWM`` after a reset through
``/proc/self/clear_refs``, minus ``VmRSS`` before; the destination tensors are allocated and touched
before the reset, so the figure is what reading itself costs: mapped file pages count, as they count
against a job's memory limit), and the anonymous memory still held after the read (``RssAnon``
growth: what a reader keeps). Printed as the worst rank's figure and as a ratio to ``ours``.

    uv run --all-packages python benchmarks/bench_safetensors_reader.py [--ranks 4] [--only small|large]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _launch import launch
from bench_checkpoint_load import MiB, _reset_peak, _status

READERS = ("ours", "safe_open", "dcp-hf")
MODELS: dict[str, dict[str, Any]] = {
    "small": {  # the 124.7M Llama of bench_checkpoint_load.py
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "large": {  # Llama-3.2-1B's shape
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
}


def write_checkpoint(folder: Path, overrides: dict[str, Any]) -> tuple[Path, int]:
    """Write a transformers-layout Llama checkpoint tensor by tensor; return (folder, parameter count)."""
    import transformers

    from automodel_checkpoint.safetensors_io import SafetensorsStreamWriter

    config = transformers.LlamaConfig(max_position_embeddings=2048, **overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    tensors = [(k, v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()]
    if config.tie_word_embeddings:  # saved once, as transformers does
        tensors = [t for t in tensors if t[0] != "lm_head.weight"]
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    with SafetensorsStreamWriter(folder / "model.safetensors", tensors) as writer:
        for name, dtype, shape in tensors:
            writer.write(name, torch.randn(shape, generator=generator, dtype=dtype))
    return folder, sum(torch.Size(shape).numel() for _, _, shape in tensors)


def _rows(length: int, rank: int, world: int) -> tuple[int, int]:
    """The rows of dim 0 that ``Shard(0)`` gives ``rank`` (``torch.chunk`` semantics)."""
    size = -(-length // world)
    start = min(rank * size, length)
    return start, min(start + size, length)


def _destinations(path: Path, rank: int, world: int) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), "pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            shape = tuple(f.get_slice(key).get_shape())
            start, stop = _rows(shape[0], rank, world)
            out[key] = (torch.ones((stop - start, *shape[1:]), dtype=torch.float32), start, shape)
    return out


def _read_ours(folder: Path, dest: dict[str, Any]) -> None:
    from automodel_checkpoint.files import resolve_checkpoint
    from automodel_checkpoint.reader import open_checkpoint
    from automodel_checkpoint.slices import Box

    reader = open_checkpoint(resolve_checkpoint(folder))
    try:
        for key, (out, start, shape) in dest.items():
            box = Box((start, *(0 for _ in shape[1:])), tuple(0 for _ in shape), tuple(out.shape))
            if box.numel:
                reader.read(key, box, out)
    finally:
        reader.close()


def _read_safe_open(folder: Path, dest: dict[str, Any]) -> None:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for key, (out, start, _) in dest.items():
            out.copy_(f.get_slice(key)[start : start + out.shape[0]])


def _read_dcp(folder: Path, dest: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {
        key: DTensor.from_local(
            out,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
        for key, (out, _, shape) in dest.items()
    }
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(folder)))


def _check(folder: Path, dest: dict[str, Any], rank: int) -> float:
    """Largest difference from the file (a reader that reads wrong fails the benchmark)."""
    from safetensors import safe_open

    worst = 0.0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for key in list(dest)[rank :: dist.get_world_size()][:8]:
            out, start, _ = dest[key]
            ref = f.get_slice(key)[start : start + out.shape[0]]
            worst = max(worst, (out - ref).abs().max().item() if out.numel() else 0.0)
    return worst


def bench_rank(folder: str, reader: str, repeats: int) -> dict[str, float]:
    """One reader on this rank, ``repeats`` times: fastest seconds, peak memory growth (MiB), anonymous
    memory left behind (MiB), largest difference from the file."""
    path = Path(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    dest = _destinations(path / "model.safetensors", rank, world)
    read = {"ours": _read_ours, "safe_open": _read_safe_open, "dcp-hf": _read_dcp}[reader]
    if reader == "dcp-hf":
        import torch.distributed.checkpoint  # noqa: F401 - import cost outside the measurement
    times, peaks, anon = [], [], []
    for _ in range(repeats):
        gc.collect()
        dist.barrier()
        anon_before = _status("RssAnon")
        base = _reset_peak()
        start = time.perf_counter()
        read(path, dest)
        times.append(time.perf_counter() - start)
        peaks.append((_status("VmHWM") - base) / MiB)
        anon.append((_status("RssAnon") - anon_before) / MiB)
        dist.barrier()
    return {
        "seconds": min(times),
        "peak_mib": max(peaks),
        "anon_mib": max(anon),
        "max_diff": _check(path, dest, rank),
    }


def _warm(folder: Path) -> None:
    with (folder / "model.safetensors").open("rb") as f:
        while f.read(64 * MiB):
            pass


def run(model: str, ranks: int, root: Path, repeats: int) -> list[dict[str, Any]]:
    """Write the checkpoint, run every reader on ``ranks`` ranks, delete it; one row per reader."""
    folder = root / model
    try:
        folder, params = write_checkpoint(folder, MODELS[model])
        _warm(folder)
        rows = []
        for reader in READERS:
            per_rank = launch(bench_rank, ranks, str(folder), reader, repeats, timeout_s=1800)
            rows.append(
                {
                    "model": model,
                    "params": params,
                    "reader": reader,
                    "seconds": max(r["seconds"] for r in per_rank),
                    "peak_mib": max(r["peak_mib"] for r in per_rank),
                    "anon_mib": max(r["anon_mib"] for r in per_rank),
                    "max_diff": max(r["max_diff"] for r in per_rank),
                }
            )
        return rows
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def report(rows: list[dict[str, Any]], ranks: int) -> str:
    """The table: worst rank's seconds and peak MiB, and ratios to ours (below 1: better than ours)."""
    lines = [
        f"{'checkpoint':<18}{'reader':<11}{'seconds':>9}{'x ours':>8}{'peak MiB':>10}{'x ours':>8}"
        f"{'anon MiB':>10}  max diff",
    ]
    for row in rows:
        ours = next(r for r in rows if r["model"] == row["model"] and r["reader"] == "ours")
        label = f"{row['model']} {row['params'] / 1e6:.1f}M"
        lines.append(
            f"{label:<18}{row['reader']:<11}{row['seconds']:>9.2f}{row['seconds'] / ours['seconds']:>8.2f}"
            f"{row['peak_mib']:>10.1f}{row['peak_mib'] / max(ours['peak_mib'], 1e-9):>8.2f}"
            f"{row['anon_mib']:>10.1f}  {row['max_diff']:.1g}"
        )
    lines.append(
        f"(worst of {ranks} gloo ranks; each reads its Shard(0) rows of every tensor; warm page cache)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--only", choices=sorted(MODELS), action="append")
    parser.add_argument("--repeats", type=int, default=3, help="reads per reader and rank (fastest counts)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp folder)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-reader-", dir=args.dir))
    try:
        rows = [
            row for model in (args.only or list(MODELS)) for row in run(model, args.ranks, root, args.repeats)
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(rows, args.ranks))


if __name__ == "__main__":
    main()
