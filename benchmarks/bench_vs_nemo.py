"""The same job through automodel and through NeMo AutoModel: apply time, memory and step time.

A Llama checkpoint (hidden 512, 8 layers, vocab 8192, fp32: about 33M parameters) is generated once.
Then a scratch virtual environment receives ``nemo-automodel`` from PyPI **and** our
``automodel-infra`` with what it needs (`OURS`) from this checkout, so both
implementations run on the very same torch and transformers. In it, ``torchrun`` launches
`_apply_worker.py` on 2 gloo ranks: ours once per setting of `_launch.HOST_SETTINGS` (the workers'
malloc as the ``automodel`` launcher chooses it, and the CPU runtime, ``FSDP2Config.host_runtime``),
then NeMo (glibc's malloc, as torchrun starts it), then the same jobs in reverse order (a fresh job
each, since NeMo patches FSDP2 classes globally): build the model on meta, ``instantiate_infrastructure`` +
``apply_model_infrastructure`` (FSDP2 over both ranks, fp32, load the checkpoint into the shards), then
SGD steps on the same batch. The import cost of each orchestration module is CPU time, as in
`bench_import_time.py`.

Why the scratch environment pins torch: nemo-automodel 0.7.0 patches a private FSDP2 method
(``FSDPParam.to_accumulated_grad_if_needed``) that torch 2.15 no longer has, so its
``apply_model_infrastructure`` raises ``AttributeError`` there; with torch 2.11 it runs on CPU. The
worker also blocks ``import triton`` for NeMo (see `_apply_worker.py`).

    uv run --all-packages python benchmarks/bench_vs_nemo.py [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _launch import HOST_SETTINGS, HostSetting

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_apply_worker.py"
NEMO_REQUIREMENT = "nemo-automodel==0.7.0"
NEMO_TORCH = "torch==2.11.*"  # see the module docstring
OURS = (
    "automodel-mesh",
    "automodel-modules",
    "automodel-checkpoint",
    "automodel-cpu",
    "automodel-distributed",
    "automodel-infra",
)
MODEL: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "max_position_embeddings": 512,
}


class NemoUnavailable(RuntimeError):
    """NeMo AutoModel could not be installed or run here; the message says why, concretely."""


def _tail(text: str, lines: int = 6) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


def _log(message: str) -> None:
    print(f"[bench_vs_nemo] {message}", file=sys.stderr, flush=True)


def make_environment(folder: Path) -> Path:
    """Create the scratch venv with nemo-automodel and our packages (`OURS`); return its python."""
    uv = shutil.which("uv")
    if uv is None:
        raise NemoUnavailable("`uv` is not on PATH, so no scratch environment can be made")
    venv = folder / "nemo-venv"
    python = venv / "bin" / "python"
    steps = [
        [uv, "venv", "--quiet", "--python", sys.executable, str(venv)],
        [
            uv, "pip", "install", "--quiet", "--python", str(python), NEMO_REQUIREMENT, NEMO_TORCH,
            *(str(ROOT / "packages" / name) for name in OURS),
        ],
    ]  # fmt: skip
    for command in steps:
        proc = subprocess.run(command, capture_output=True, text=True, check=False, cwd=folder)
        if proc.returncode != 0:
            raise NemoUnavailable(f"`{' '.join(command[:3])} ...` failed: {_tail(proc.stderr)}")
    return python


def run_job(
    python: Path, impl: str, checkpoint: Path, out: Path, *extra: str, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run `_apply_worker.py` on 2 ranks with ``python``'s torchrun; return the per-rank results.

    ``env``: extra environment variables of the job (`HostSetting.env`: the workers' malloc)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("PYTHONPATH", None)  # the scratch venv must not see the workspace's packages
    command = [
        str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
        "--impl", impl, "--checkpoint", str(checkpoint), "--out", str(out / impl), *extra,
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False, timeout=900)
    if proc.returncode != 0:
        errors = "\n".join(line for line in proc.stderr.splitlines() if "Error" in line and "rank" in line)
        raise NemoUnavailable(
            f"the {impl} job failed (exit {proc.returncode}): {_tail(errors or proc.stderr, 3)}"
        )
    return [json.loads((out / impl / f"rank{r}.json").read_text()) for r in range(2)]


def import_times(python: Path, repeats: int = 2) -> dict[str, float]:
    """CPU seconds of importing torch and each implementation's orchestration module (fresh processes)."""
    from bench_import_time import best_of

    modules = {
        "torch": ("torch", ""),
        "automodel": ("automodel_infra.infrastructure", ""),
        "nemo": ("nemo_automodel._transformers.infrastructure", "import sys; sys.modules['triton'] = None; "),
    }
    try:
        return best_of(str(python), modules, repeats)
    except RuntimeError as exc:
        raise NemoUnavailable(str(exc)) from exc


def measure(folder: Path, steps: int = 5, settings: Sequence[HostSetting] = HOST_SETTINGS) -> dict[str, Any]:
    """Install, then run the jobs; per implementation: means over its jobs of the maxima over ranks.

    Ours runs once per `HostSetting` in ``settings`` (the workers' malloc and
    the CPU runtime (``FSDP2Config.host_runtime``), both process-wide, so each gets its own jobs);
    ``results["automodel"][setting.label]`` holds its figures. NeMo runs under glibc's malloc with its
    defaults, as torchrun starts it. Every figure ``key`` also comes as ``key + "_runs"``: one value per
    job, in job order.
    """
    from automodel_testing import save_tiny_checkpoint

    checkpoint = folder / "llama-33m"
    save_tiny_checkpoint("llama", checkpoint, seed=0, **MODEL)
    start = time.perf_counter()
    python = make_environment(folder)
    results: dict[str, Any] = {"install_s": time.perf_counter() - start}
    _log(f"scratch environment ready in {results['install_s']:.0f} s")
    # Ours, NeMo, then the same jobs in reverse: each runs twice, first and last, so a drift in machine
    # load over the run hits all alike; every job is a fresh torchrun.
    forward: list[tuple[str, HostSetting | None]] = [("automodel", s) for s in settings] + [("nemo", None)]
    order = forward + forward[::-1]
    jobs: dict[tuple[str, HostSetting | None], list[dict[str, Any]]] = {job: [] for job in forward}
    for index, (impl, setting) in enumerate(order):
        extra = ["--steps", str(steps)]
        if setting is not None:
            extra += ["--cpu-runtime", str(setting.cpu_runtime).lower()]
        env = setting.env() if setting is not None else None
        start = time.perf_counter()
        per_rank = run_job(python, impl, checkpoint, folder / f"out{index}", *extra, env=env)
        what = setting.label if setting is not None else "glibc defaults"
        _log(f"{impl} job ({what}): {time.perf_counter() - start:.0f} s")
        jobs[impl, setting].append(
            {
                key: max(r[key] for r in per_rank)
                for key in ("apply_s", "apply_peak_mib", "peak_mib", "step_s")
            }
            | {"losses": [r["losses"] for r in per_rank]}
        )
        results["torch"], results["transformers"] = per_rank[0]["torch"], per_rank[0]["transformers"]
    names = {setting: f"ours[{i}]" for i, setting in enumerate(settings)}
    results["order"] = " ".join("NeMo" if impl == "nemo" else names[setting] for impl, setting in order)
    results["automodel"] = {}
    for (_, setting), runs in jobs.items():
        figures: dict[str, Any] = {}
        for key in runs[0]:
            if key != "losses":
                figures[key] = statistics.mean(run[key] for run in runs)
                figures[key + "_runs"] = [run[key] for run in runs]
        figures["losses"] = [run["losses"] for run in runs]
        if setting is None:
            results["nemo"] = figures
        else:
            results["automodel"][setting.label] = figures
    start = time.perf_counter()
    results["imports"] = import_times(python)
    _log(f"import times: {time.perf_counter() - start:.0f} s")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed SGD steps per job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-nemo-") as tmp:
        try:
            r = measure(Path(tmp), args.steps)
        except NemoUnavailable as exc:
            print(f"NeMo AutoModel comparison not run: {exc}")
            return
    nemo = r["nemo"]
    print(
        f"torch {r['torch']}, transformers {r['transformers']} (scratch env made in {r['install_s']:.0f} s); "
        f"jobs {r['order']}"
    )
    for label, ours in r["automodel"].items():
        print(f"automodel with {label}:")
        for key, label in (("apply_s", "apply s"), ("peak_mib", "peak MiB apply+step"), ("step_s", "step s")):
            ratio = ours[key] / nemo[key]
            print(f"  {label:<22} automodel {ours[key]:8.3f}  nemo {nemo[key]:8.3f}  ratio {ratio:.2f}")
        print(f"  same losses: {ours['losses'] == nemo['losses']}")
    imports = r["imports"]
    ours_ratio, nemo_ratio = imports["automodel"] / imports["torch"], imports["nemo"] / imports["torch"]
    print(
        f"import of the orchestration module / import torch: automodel {ours_ratio:.2f}, "
        f"nemo {nemo_ratio:.2f}"
    )


if __name__ == "__main__":
    main()
