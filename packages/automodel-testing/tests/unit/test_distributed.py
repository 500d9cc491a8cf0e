"""run_distributed: results, failure reporting and timeouts on real gloo ranks.

The worker functions live in this module on purpose: pytest imports it with --import-mode=importlib,
so the ranks must load it from its file.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

from automodel_testing import DistributedRunError, available_gpus, run_distributed, skip_unless_gpus
from automodel_testing.distributed import _stop_all


@dataclass(frozen=True)
class RankReport:
    """Defined in the test module: pickled back from the ranks, so the module must be importable there."""

    rank: int
    total: float
    env: dict[str, str]
    num_threads: int
    offset: int


def _report_rank(offset: int, *, scale: float) -> RankReport:
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {key: os.environ[key] for key in (*keys, "OMP_NUM_THREADS", "AUTOMODEL_TEST_FLAG")}
    return RankReport(rank, float(t.item()), env, torch.get_num_threads(), offset)


def _fail_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def _exit_on_rank_1() -> int:
    if int(os.environ["RANK"]) == 1:
        os._exit(3)
    return 0


def _crash_on_rank_1() -> int:
    if int(os.environ["RANK"]) == 1:
        signal.raise_signal(signal.SIGSEGV)  # what a native crash in torch or gloo delivers
    return 0


def _sleep_on_rank_1() -> int:
    if int(os.environ["RANK"]) == 1:
        time.sleep(3600)
    return int(os.environ["RANK"])


def _no_group() -> bool:
    return dist.is_initialized()


@pytest.mark.distributed
def test_returns_per_rank_values_and_sets_env() -> None:
    reports = run_distributed(_report_rank, 2, 7, scale=2.0, env={"AUTOMODEL_TEST_FLAG": "on"})
    assert [r.rank for r in reports] == [0, 1]
    assert [r.total for r in reports] == [6.0, 6.0]  # (1 + 2) * 2 on every rank
    assert all(r.offset == 7 for r in reports)
    for rank, report in enumerate(reports):
        assert report.env["RANK"] == report.env["LOCAL_RANK"] == str(rank)
        assert report.env["WORLD_SIZE"] == report.env["LOCAL_WORLD_SIZE"] == "2"
        assert report.env["MASTER_ADDR"] == "127.0.0.1"
        assert int(report.env["MASTER_PORT"]) > 0
        assert report.env["OMP_NUM_THREADS"] == "1"
        assert report.env["AUTOMODEL_TEST_FLAG"] == "on"
        assert report.num_threads == 1
    assert reports[0].env["MASTER_PORT"] == reports[1].env["MASTER_PORT"]


def _where_am_i() -> dict[str, Any]:
    return {
        "cwd": os.getcwd(),
        "late": os.environ.get("AUTOMODEL_TEST_LATE"),
        "gone": os.environ.get("AUTOMODEL_TEST_GONE"),
        "parent": os.getppid(),
        "pid": os.getpid(),
    }


@pytest.mark.distributed
def test_ranks_see_the_callers_environment_and_directory_at_launch(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fork server starts at the first launch and outlives it: what the caller changes afterwards
    # (a variable set or removed, the working directory) must still reach the next launch's ranks.
    monkeypatch.setenv("AUTOMODEL_TEST_GONE", "set before the first launch")
    first = run_distributed(_where_am_i, 2)
    assert all(r["gone"] == "set before the first launch" for r in first)
    monkeypatch.delenv("AUTOMODEL_TEST_GONE")
    monkeypatch.setenv("AUTOMODEL_TEST_LATE", "set after the first launch")
    monkeypatch.chdir(tmp_path)
    second = run_distributed(_where_am_i, 2)
    for report in second:
        assert report["cwd"] == str(tmp_path)
        assert report["late"] == "set after the first launch"
        assert report["gone"] is None
        assert report["parent"] != os.getpid(), "ranks are forked by the fork server, not by the caller"
    assert {r["pid"] for r in first}.isdisjoint(r["pid"] for r in second), "every launch forks new ranks"


@pytest.mark.distributed
def test_without_process_group() -> None:
    assert run_distributed(_no_group, 1, init_process_group=False) == [False]


@pytest.mark.distributed
def test_failing_rank_is_reported_without_hanging() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_fail_on_rank_1, 2, timeout_s=120.0, pg_timeout_s=60.0)
    assert time.monotonic() - start < 40.0  # neither the run timeout nor the collective timeout
    message = str(info.value)
    assert "boom on rank 1" in message
    assert "first failure on rank 1" in message
    assert "ValueError" in info.value.failures[1]
    assert isinstance(info.value, AssertionError)


@pytest.mark.distributed
def test_rank_that_exits_is_reported_with_its_exit_code() -> None:
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_exit_on_rank_1, 2, init_process_group=False, timeout_s=120.0)
    message = str(info.value)
    assert "rank 1: no report (its output ends below); exited with code 3" in message
    assert info.value.failures == {1: "exited with code 3"}
    assert 1 not in info.value.unfinished


@pytest.mark.distributed
def test_a_native_crash_prints_the_python_stack_of_the_rank(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_crash_on_rank_1, 2, init_process_group=False, timeout_s=120.0)
    assert info.value.failures == {1: "killed by signal SIGSEGV"}
    # faulthandler's report, in the error and on this test's stderr: it names the function that crashed
    for text in (str(info.value), capfd.readouterr().err):
        assert "Fatal Python error: Segmentation fault" in text
        assert "in _crash_on_rank_1" in text


@pytest.mark.distributed
def test_timeout_kills_hung_ranks() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="timed out after 5 s") as info:
        run_distributed(_sleep_on_rank_1, 2, init_process_group=False, timeout_s=5.0)
    assert time.monotonic() - start < 5.0 + 5.0
    assert 1 in info.value.unfinished
    assert "rank 1: no report; still running, stopped (killed by signal SIG" in str(info.value)
    assert "in _sleep_on_rank_1" in str(info.value)  # the hung rank's stack, written before it was stopped


def _ignore_sigterm_and_sleep(ready: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(3600)


def test_stop_escalates_to_sigkill() -> None:
    ctx = mp.get_context("fork")  # fast: this check needs no torch in the child
    ready = ctx.Event()
    proc = ctx.Process(target=_ignore_sigterm_and_sleep, args=(ready,))
    proc.start()
    assert ready.wait(30)
    _stop_all([proc])
    assert proc.exitcode == -signal.SIGKILL


def test_rejects_lambdas_and_nested_functions() -> None:
    def nested() -> None:
        pass

    with pytest.raises(ValueError, match="lambdas and nested functions"):
        run_distributed(lambda: None, 1)
    with pytest.raises(ValueError, match="lambdas and nested functions"):
        run_distributed(nested, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size >= 1"),
        ({"world_size": 1, "device": "tpu"}, "device must be one of"),
        ({"world_size": 1, "timeout_s": 0}, "timeouts must be > 0"),
        ({"world_size": 1, "env": {"RANK": "3"}}, "sets \\['RANK'\\] per rank"),
        ({"world_size": available_gpus() + 1, "device": "cuda"}, "CUDA devices, found"),
        ({"world_size": 1, "start_method": "fork"}, "start_method must be"),
        ({"world_size": 1, "env": {"LD_PRELOAD": "libx.so"}}, "pass start_method='spawn'"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_distributed(_no_group, **kwargs)  # type: ignore[arg-type]


def test_skip_unless_gpus_marker() -> None:
    marker = skip_unless_gpus(available_gpus() + 1)
    assert marker.kwargs["reason"] == f"needs {available_gpus() + 1} CUDA devices, found {available_gpus()}"
    assert marker.args == (True,)
    with pytest.raises(ValueError, match="n >= 1"):
        skip_unless_gpus(0)
