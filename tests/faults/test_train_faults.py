"""Faults injected into real ``automodel train`` jobs (2 gloo workers each, started by the launcher).

Every case runs the command as a user would (``python -m automodel_all.cli train ...``) and compares
with one uninterrupted reference run of the same job (module fixture). Faults are real: a worker is
SIGKILLed, the launcher or one worker gets SIGTERM / SIGUSR1, a byte of a checkpoint is flipped, the
disk fills up (a small tmpfs in a private mount namespace), the learning rate makes the weights
overflow. A watcher thread reads the job's ``train_log.jsonl`` (or watches its checkpoint folder) to
pick the moment; nothing of ours is patched.

- elastic restart (``--max-restarts 1``): a worker is killed after the step-10 checkpoint; torchrun
  restarts the group, which resumes from the newest complete checkpoint on its own; every logged loss
  equals the reference (1e-6).
- preemption during a save: SIGTERM to the launcher while the step-10 checkpoint is being written in
  the background, then (in the resumed job, with HF weights in each checkpoint) SIGUSR1 to ONE worker
  only while the step-20 checkpoint's HF export is being written: each time the save in flight is
  published, the workers finish the step, save a checkpoint and exit 0 within
  ``launch.shutdown_timeout``, and no incomplete folder is left; a third launch with ``--resume``
  finishes; the losses of all three equal the reference.
- two "nodes" on one host: two launches ``--nnodes 2 --node-rank 0/1 --rdzv-endpoint 127.0.0.1:PORT``
  of 2 workers each, HSDP replicating across them, give the losses of one 4-worker launch.
- integrity: a flipped byte in the newest checkpoint stops ``--resume`` with an error naming the file;
  ``--resume-fallback`` resumes from the previous checkpoint and gives the reference losses.
- disk full: the checkpoint at step 4 does not fit the output folder's tmpfs: the job fails with a
  clear error, the step-2 checkpoint is intact (verified), nothing else is published or left behind.
- NaN/Inf: a learning rate that makes the weights overflow; the job stops at step 2 naming the step and
  both ranks, the step-1 checkpoint is finite and is the last; with ``train.on_nonfinite: skip`` the job
  finishes, counting 3 skipped steps, and its final checkpoint is finite.

Each case records itself in the faults ledger (docs/faults.md). The elastic restart, the preemption,
the two simulated nodes and the skip-on-NaN job carry ``slow_faults`` (the non-default ``faults_slow``
session): together they cost about 220 s of a shared 2-core machine.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS = 30
JOB = [
    "--steps", str(STEPS), "--checkpoint-every", "10", "--seq-len", "32", "--global-batch-size", "8",
    "--micro-batch-size", "4", "--warmup-steps", "2", "--lr", "0.005", "--nproc-per-node", "2",
    "--device", "cpu", "--set", "model.config_overrides={num_hidden_layers: 1}",
    "--set", "train.keep_checkpoints=0", "--set", "train.sample_tokens=0", "--set", "train.plot=false",
]  # fmt: skip
LOSS_ATOL = 1e-6
SHUTDOWN_S = 30  # launch.shutdown_timeout in the preemption case: the bound on exiting after a signal


def _command(output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "automodel_all.cli", "train", *JOB, "--output-dir", str(output), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _losses(output: Path) -> dict[int, float]:
    path = output / "train_log.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _last_step(output: Path) -> int:
    losses = _losses(output)
    return max(losses) if losses else 0


def _workers(pid: int) -> list[int]:
    """Worker processes of a launcher: its children running the worker module (torchrun's subprocesses)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid and b"automodel_all.cli.train" in command:
            found.append(int(entry.name))
    return sorted(found)


class _Job:
    """One ``automodel train`` process, with a watcher that acts once a step has been logged."""

    def __init__(self, command: list[str], output: Path) -> None:
        self.output = output
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.acted_at: float | None = None
        self.action_step: int | None = None
        self._watcher: threading.Thread | None = None

    def when(self, condition: Callable[[], bool], action: Callable[[int], None]) -> None:
        """Call ``action(launcher_pid)`` as soon as ``condition()`` holds (polled from a thread)."""

        def watch() -> None:
            while self.process.poll() is None:
                if condition():
                    self.action_step = _last_step(self.output)
                    action(self.process.pid)
                    self.acted_at = time.monotonic()
                    return
                time.sleep(0.002)

        self._watcher = threading.Thread(target=watch, daemon=True)
        self._watcher.start()

    def wait(self, timeout: float = 420) -> tuple[int, str]:
        out, _ = self.process.communicate(timeout=timeout)
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        return self.process.returncode, out


def _run(output: Path, *extra: str) -> tuple[int, str]:
    return _Job(_command(output, *extra), output).wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    output = tmp_path_factory.mktemp("reference") / "run"
    code, out = _run(output)
    assert code == 0, out[-6000:]
    losses = _losses(output)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return output, losses


def _max_difference(losses: dict[int, float], expected: dict[int, float]) -> float:
    assert sorted(losses) == sorted(expected), (sorted(losses), sorted(expected))
    return max(abs(losses[s] - expected[s]) for s in expected)


def _seed_folder(reference: Path, target: Path) -> None:
    """The reference's tokenizer and initial weights (the launcher would make the same ones again)."""
    target.mkdir(parents=True)
    for name in ("tokenizer", "init"):
        shutil.copytree(reference / name, target / name)


# ------------------------------------------------------------------------------------------------ cases


@pytest.mark.slow_faults  # a minute of a shared 2-core machine
def test_a_killed_worker_is_restarted_and_the_run_resumes_exactly(
    reference: tuple[Path, dict[int, float]], tmp_path: Path, fault_ledger: Any
) -> None:
    ref_dir, expected = reference
    output = tmp_path / "run"
    _seed_folder(ref_dir, output)
    from automodel_checkpoint import is_complete_checkpoint

    job = _Job(_command(output, "--max-restarts", "1"), output)
    # After step 13 and once the step-10 checkpoint is published: it is written in the background, and
    # on a loaded machine it can still be in flight three steps later (then a restart starts over).
    step_10 = output / "checkpoints" / "step_00000010"
    job.when(
        lambda: _last_step(output) >= 13 and is_complete_checkpoint(step_10),
        lambda pid: os.kill(_workers(pid)[-1], signal.SIGKILL),
    )
    code, out = job.wait()
    assert code == 0, out[-6000:]
    assert job.action_step is not None and job.action_step < STEPS, job.action_step
    assert "(restart 1 by the launcher)" in out and "resumed from" in out, out[-4000:]
    difference = _max_difference(_losses(output), expected)
    fault_ledger.fault(
        "automodel train: elastic restart (2 workers)",
        f"SIGKILL a worker after step {job.action_step}, --max-restarts 1: resumed, max loss difference "
        f"{difference:.1e}",
        hung=False,
        seconds=None,
        data_lost=difference > LOSS_ATOL,
    )
    assert difference <= LOSS_ATOL


def _preempt(sig: signal.Signals, *, one_worker: bool) -> Callable[[int], None]:
    def act(pid: int) -> None:
        os.kill(_workers(pid)[0] if one_worker else pid, sig)

    return act


def _saving(output: Path, step: int, inner: str = "") -> Callable[[], bool]:
    """Whether the step's checkpoint is being written (its staging folder, or ``inner`` in it, exists)."""
    staging = output / "checkpoints" / f".step_{step:08d}.incomplete"
    return lambda: (staging / inner).is_dir()


@pytest.mark.slow_faults  # three launches: a minute of a shared 2-core machine
def test_sigterm_and_sigusr1_checkpoint_exit_0_and_resume_exactly(
    reference: tuple[Path, dict[int, float]], tmp_path: Path, fault_ledger: Any
) -> None:
    """The signals come while a checkpoint is being written: the asynchronous DCP save of step 10, then
    (``train.hf_checkpoints=also``) the HF export inside the step-20 checkpoint. Each save in flight is
    finished and published, then the preemption checkpoint; nothing incomplete is left."""
    from automodel_checkpoint import is_complete_checkpoint

    ref_dir, expected = reference
    output = tmp_path / "run"
    _seed_folder(ref_dir, output)
    extra = ("--shutdown-timeout", str(SHUTDOWN_S), "--resume")
    stops = []
    cases = (
        (signal.SIGTERM, False, 10, _saving(output, 10), ()),
        (
            signal.SIGUSR1,
            True,
            20,
            _saving(output, 20, ".hf.incomplete"),
            ("--set", "train.hf_checkpoints=also"),
        ),
    )
    for sig, one_worker, saving, during, options in cases:
        job = _Job(_command(output, *extra, *options), output)
        job.when(during, _preempt(sig, one_worker=one_worker))
        code, out = job.wait()
        assert job.acted_at is not None, out[-4000:]
        seconds = time.monotonic() - job.acted_at
        stopped = _last_step(output)
        checkpoints = output / "checkpoints"
        marker = json.loads((checkpoints / f"step_{stopped:08d}" / ".automodel_complete.json").read_text())
        left = sorted(p.name for p in checkpoints.iterdir() if p.name.endswith(".incomplete"))
        interrupted = checkpoints / f"step_{saving:08d}"
        ok = code == 0 and marker["extra_state"]["reason"] == "preempted" and seconds < SHUTDOWN_S
        ok = ok and is_complete_checkpoint(interrupted) and not left
        who = "one worker" if one_worker else "the launcher"
        what = "its HF export" if options else "its asynchronous write"
        fault_ledger.fault(
            "automodel train: preemption during a save (2 workers)",
            f"{sig.name} to {who} during the step-{saving} checkpoint ({what}): that checkpoint "
            f"published, preemption checkpoint at step {stopped}, exit {code}",
            hung=seconds >= SHUTDOWN_S,
            seconds=seconds,
            data_lost=not ok,
        )
        assert code == 0, out[-6000:]
        assert f"stopped by {sig.name}" in out, out[-3000:]
        assert marker["extra_state"]["reason"] == "preempted" and stopped < STEPS, (stopped, marker)
        assert is_complete_checkpoint(interrupted) and not left, (interrupted, left)
        if options:
            assert (interrupted / "hf" / "config.json").is_file()
        assert seconds < SHUTDOWN_S
        stops.append(stopped)
    code, out = _run(output, *extra)
    assert code == 0, out[-6000:]
    assert f"resumed from {output / 'checkpoints' / f'step_{stops[-1]:08d}'}" in out
    difference = _max_difference(_losses(output), expected)
    fault_ledger.fault(
        "automodel train: resume after preemption",
        f"stopped at steps {stops}, third launch finished: max loss difference {difference:.1e}",
        hung=False,
        seconds=None,
        data_lost=difference > LOSS_ATOL,
    )
    assert difference <= LOSS_ATOL


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow_faults  # three launches of 4 workers in all: ~80 s on a shared 2-core machine
def test_two_nodes_on_one_host_give_the_losses_of_one_four_worker_launch(
    reference: tuple[Path, dict[int, float]], tmp_path: Path, fault_ledger: Any
) -> None:
    ref_dir, _ = reference
    short = ("--steps", "6", "--dp-replicate", "2", "--micro-batch-size", "2")
    single = tmp_path / "single"
    _seed_folder(ref_dir, single)
    code, out = _run(single, *short, "--nproc-per-node", "4")
    assert code == 0, out[-6000:]
    nodes = tmp_path / "nodes"
    _seed_folder(ref_dir, nodes)
    port = _free_port()
    rendezvous = ("--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}")
    jobs = [_Job(_command(nodes, *short, *rendezvous, "--node-rank", str(rank)), nodes) for rank in (0, 1)]
    results = [job.wait() for job in jobs]
    for code, out in results:
        assert code == 0, out[-6000:]
    assert "dp_replicate=2" in results[0][1]
    difference = _max_difference(_losses(nodes), _losses(single))
    fault_ledger.fault(
        "automodel train: two nodes on one host",
        f"--nnodes 2 x 2 workers, HSDP across them, vs one 4-worker launch: max loss difference "
        f"{difference:.1e}",
        hung=False,
        seconds=None,
        data_lost=difference > LOSS_ATOL,
    )
    assert difference <= LOSS_ATOL


def test_a_flipped_byte_stops_resume_naming_the_file_and_fallback_resumes_exactly(
    reference: tuple[Path, dict[int, float]], tmp_path: Path, fault_ledger: Any
) -> None:
    ref_dir, expected = reference
    output = tmp_path / "run"
    shutil.copytree(ref_dir, output, ignore=shutil.ignore_patterns(f"step_{STEPS:08d}", "hf"))
    newest = output / "checkpoints" / f"step_{STEPS - 10:08d}"
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10
    shard.write_bytes(bytes(data))
    code, out = _run(output, "--resume")
    clear = code != 0 and f"{shard} is corrupt" in out and "--resume-fallback" in out
    fault_ledger.fault(
        "automodel train: corrupt checkpoint",
        "a flipped byte in the newest checkpoint, --resume: error naming the file",
        hung=False,
        seconds=None,
        data_lost=not clear,
    )
    assert clear, out[-6000:]
    code, out = _run(output, "--resume", "--resume-fallback")
    assert code == 0, out[-6000:]
    previous = output / "checkpoints" / f"step_{STEPS - 20:08d}"
    assert f"resumed from {previous} (step {STEPS - 20})" in out, out[-3000:]
    assert f"resuming from the previous checkpoint {previous}" in out
    difference = _max_difference(_losses(output), expected)
    fault_ledger.fault(
        "automodel train: corrupt checkpoint",
        f"--resume-fallback: resumed from step {STEPS - 20}, max loss difference {difference:.1e}",
        hung=False,
        seconds=None,
        data_lost=difference > LOSS_ATOL,
    )
    assert difference <= LOSS_ATOL


_CHECK_AFTER_DISK_FULL = r"""
import json, sys
from pathlib import Path
from automodel_checkpoint import COMPLETE_MARKER, complete_checkpoints, read_marker
from automodel_checkpoint import verify_checkpoint
root = Path(sys.argv[1]) / "checkpoints"
found = complete_checkpoints(root, kind="dcp")
ok = [str(p.name) for p in found]
for path in found:
    verify_checkpoint(path, read_marker(path)["files"], exclude=frozenset({COMPLETE_MARKER}))
print("CHECK", json.dumps({"complete": ok, "entries": sorted(p.name for p in root.iterdir())}))
"""


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(
    reference: tuple[Path, dict[int, float]], tmp_path: Path, fault_ledger: Any
) -> None:
    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False).returncode
    ):
        pytest.skip("needs `unshare -m` (a private mount namespace) to mount a small tmpfs")
    ref_dir, _ = reference
    mount = tmp_path / "disk"
    mount.mkdir()
    seed = tmp_path / "seed"
    _seed_folder(ref_dir, seed)
    # One checkpoint of this job is ~9 MB (2 ranks' model + AdamW shards); with the tokenizer, the initial
    # weights and the data (~5 MB) a 16 MB disk holds the step-2 checkpoint but not the step-4 one too.
    train = shlex.join(
        _command(
            mount / "out", "--steps", "6", "--checkpoint-every", "2", "--set", "train.keep_checkpoints=2"
        )
    )
    script = (
        f"mount -t tmpfs -o size=16m tmpfs {mount} && mkdir {mount}/out && cp -r {seed}/. {mount}/out/ && "
        f"{train}; echo EXIT $?; df -k {mount} | tail -1; "
        f"{shlex.join([sys.executable, '-c', _CHECK_AFTER_DISK_FULL, str(mount / 'out')])}"
    )
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    out = result.stdout + result.stderr
    exit_line = next((line for line in out.splitlines() if line.startswith("EXIT ")), "EXIT ?")
    check_line = next((line for line in out.splitlines() if line.startswith("CHECK ")), None)
    state = json.loads(check_line[6:]) if check_line else {}
    clear = "No space left on device" in out and "the previous checkpoints are intact" in out
    kept = state.get("complete") == ["step_00000002"] and state.get("entries") == ["step_00000002"]
    fault_ledger.fault(
        "automodel train: disk full during a save",
        "16 MB tmpfs (private mount namespace), the step-4 checkpoint does not fit: clear error, step 2 kept",
        hung=False,
        seconds=None,
        data_lost=not (kept and exit_line != "EXIT 0" and clear),
    )
    assert exit_line != "EXIT 0" and clear, out[-6000:]
    assert kept, (state, out[-3000:])


DIVERGE = ("--steps", "4", "--checkpoint-every", "1", "--lr", "1e15", "--warmup-steps", "0")


def test_a_nan_loss_stops_naming_the_step_and_the_ranks(
    reference: tuple[Path, dict[int, float]], tmp_path: Path, fault_ledger: Any
) -> None:
    ref_dir, _ = reference
    output = tmp_path / "error"
    _seed_folder(ref_dir, output)
    code, out = _run(output, *DIVERGE)
    clear = code != 0 and "NonFiniteError: step 2: the loss is NaN or Inf on rank(s) [0, 1]" in out
    names = sorted(p.name for p in (output / "checkpoints").iterdir())
    fault_ledger.fault(
        "automodel train: NaN loss",
        "lr 1e15: stops at step 2 naming the ranks; the last checkpoint is step 1",
        hung=False,
        seconds=None,
        data_lost=not (clear and names == ["step_00000001"]),
    )
    assert clear, out[-6000:]
    assert names == ["step_00000001"]


@pytest.mark.slow_faults
def test_a_nan_loss_is_skipped_and_counted_when_asked(
    reference: tuple[Path, dict[int, float]], tmp_path: Path, fault_ledger: Any
) -> None:
    ref_dir, _ = reference
    output = tmp_path / "skip"
    _seed_folder(ref_dir, output)
    code, out = _run(output, *DIVERGE, "--set", "train.on_nonfinite=skip")
    assert code == 0, out[-6000:]
    log = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in log] == [False, True, True, True] and log[-1]["skipped_total"] == 3
    noticed = "warning: step 2: the loss is NaN or Inf on rank(s) [0, 1]" in out
    noticed = noticed and "skipped (no update), 3 step(s) skipped so far" in out
    fault_ledger.fault(
        "automodel train: NaN loss",
        "train.on_nonfinite: skip: 3 steps skipped and counted, the final checkpoint is finite",
        hung=False,
        seconds=None,
        data_lost=not (noticed and (output / "hf" / "config.json").is_file()),
    )
    assert noticed, out[-3000:]
