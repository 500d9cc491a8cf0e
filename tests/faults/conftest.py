"""The fault ledger: every faults test records what it tried; the session writes a JSON and a table.

Tests get the ledger through the session-scoped ``fault_ledger`` fixture (session scope, so hypothesis
tests may use it too) and record:

- ``bad_input(category, case, clear=..., detail=...)``: one input that must be rejected (or was drawn
  at random and may be valid: ``valid=True``). ``clear`` means "a ValueError / ImportError /
  FileNotFoundError that names the offending field or thing, raised before any collective".
- ``fault(category, case, hung=..., seconds=..., data_lost=..., detail=...)``: one injected fault.

At the end of the session the totals go to ``$AUTOMODEL_FAULTS_REPORT`` (default
``build/faults/report.json`` under the repository root) and a Markdown table is printed, ready to paste
into docs/faults.md.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FaultLedger:
    """Counts of bad inputs and injected faults, by category."""

    inputs: dict[str, dict[str, int]] = field(default_factory=dict)
    unclear: list[dict[str, str]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def bad_input(
        self, category: str, case: str, *, clear: bool, valid: bool = False, detail: str = ""
    ) -> None:
        """Record one input: ``valid`` (built fine), else rejected ``clear``-ly or not."""
        with self._lock:
            row = self.inputs.setdefault(
                category, {"tried": 0, "valid": 0, "rejected_clearly": 0, "unclear": 0}
            )
            row["tried"] += 1
            if valid:
                row["valid"] += 1
            elif clear:
                row["rejected_clearly"] += 1
            else:
                row["unclear"] += 1
                self.unclear.append({"category": category, "case": case, "detail": detail[:500]})

    def fault(
        self,
        category: str,
        case: str,
        *,
        hung: bool,
        seconds: float | None,
        data_lost: bool,
        detail: str = "",
    ) -> None:
        """Record one injected fault and how the run ended."""
        with self._lock:
            self.faults.append(
                {
                    "category": category,
                    "case": case,
                    "hung": hung,
                    "seconds_to_error": None if seconds is None else round(seconds, 2),
                    "data_lost": data_lost,
                    "detail": detail[:300],
                }
            )

    def to_json(self) -> dict[str, Any]:
        totals = {
            "bad_inputs_tried": sum(r["tried"] - r["valid"] for r in self.inputs.values()),
            "random_inputs_valid": sum(r["valid"] for r in self.inputs.values()),
            "rejected_clearly": sum(r["rejected_clearly"] for r in self.inputs.values()),
            "unclear": sum(r["unclear"] for r in self.inputs.values()),
            "faults_injected": len(self.faults),
            "hung": sum(f["hung"] for f in self.faults),
            "data_lost": sum(f["data_lost"] for f in self.faults),
        }
        return {"totals": totals, "inputs": self.inputs, "unclear": self.unclear, "faults": self.faults}

    def table(self) -> str:
        """Markdown tables: inputs by category, then faults one per row."""
        lines = [
            "| input category | inputs tried | valid (built) | rejected with a clear error "
            "| unclear / wrong error |",
            "|---|---:|---:|---:|---:|",
        ]
        for name in sorted(self.inputs):
            r = self.inputs[name]
            lines.append(
                f"| {name} | {r['tried']} | {r['valid']} | {r['rejected_clearly']} | {r['unclear']} |"
            )
        t = self.to_json()["totals"]
        tried = t["bad_inputs_tried"] + t["random_inputs_valid"]
        lines.append(
            f"| **total** | **{tried}** | **{t['random_inputs_valid']}** | **{t['rejected_clearly']}** | "
            f"**{t['unclear']}** |"
        )
        lines += ["", "| fault | case | hung | seconds to error | data lost |", "|---|---|---|---:|---|"]
        for f in self.faults:
            seconds = "-" if f["seconds_to_error"] is None else f"{f['seconds_to_error']:.1f}"
            lines.append(
                f"| {f['category']} | {f['case']} | {'yes' if f['hung'] else 'no'} | {seconds} | "
                f"{'yes' if f['data_lost'] else 'no'} |"
            )
        lines.append(
            f"| **total** | **{t['faults_injected']} faults** | **{t['hung']} hung** | | "
            f"**{t['data_lost']} lost** |"
        )
        return "\n".join(lines)


_LEDGER = FaultLedger()


@pytest.fixture(scope="session")
def fault_ledger() -> FaultLedger:
    """The session's ledger (see the module docstring)."""
    return _LEDGER


def _report_path() -> Path:
    return Path(os.environ.get("AUTOMODEL_FAULTS_REPORT") or ROOT / "build" / "faults" / "report.json")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not (_LEDGER.inputs or _LEDGER.faults):
        return
    path = _report_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_LEDGER.to_json(), indent=1) + "\n", encoding="utf-8")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not (_LEDGER.inputs or _LEDGER.faults):
        return
    terminalreporter.section("faults ledger")
    terminalreporter.write_line(_LEDGER.table())
    for row in _LEDGER.unclear:
        terminalreporter.write_line(f"UNCLEAR {row['category']} / {row['case']}: {row['detail']}")
    terminalreporter.write_line(f"(written to {_report_path()})")
