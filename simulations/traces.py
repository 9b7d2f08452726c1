"""Trace files for the simulator: jobs replayed by `kind: trace` workloads, one CSV row each.

`load_trace` reads a whole CSV file into a columnar `Trace` (numpy arrays in file order, not
sorted). The header row names the columns: all of REQUIRED_COLUMNS, any of OPTIONAL_COLUMNS, in
any order (docs/simulation-workloads.md describes each). Blank lines and lines starting with #
are skipped. String columns (model, tenant, data_region) become codes into tables of their
distinct values, in order of first appearance. simulations.arrivals scales, offsets and repeats
the rows as the workload says.

Errors: `WorkloadError` (simulations.workloads), one line naming the file:line and column, for a
file that is missing, unreadable or not UTF-8, a bad header, or a bad cell. `load_trace` returns
the whole trace or raises: nothing half-parsed.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simulations.workloads import F64, I32, I64, INT32_MAX, WorkloadError

__all__ = ["OPTIONAL_COLUMNS", "REQUIRED_COLUMNS", "Trace", "load_trace"]

REQUIRED_COLUMNS: tuple[str, ...] = ("arrival_s", "gpus", "duration_s")
OPTIONAL_COLUMNS: tuple[str, ...] = (
    "model",
    "data_region",
    "tenant",
    "cpu",
    "mem_gb",
    "priority",
    "data_size_gb",
)


@dataclass(frozen=True)
class Trace:
    """A parsed trace file, one row per job, in file order (not sorted).

    Not given: cpu -1, mem_gb NaN (the workload's defaults apply), priority 0, data_size_gb 0,
    model and data_region -1, tenant "default".
    """

    path: str
    arrival_s: F64
    gpus: I32
    duration_s: F64
    cpu: I32
    mem_gb: F64
    priority: I32
    data_size_gb: F64
    model: I64
    models: tuple[str, ...]
    tenant: I64
    tenants: tuple[str, ...]
    data_region: I64
    regions: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.arrival_s)


def load_trace(path: Path) -> Trace:
    """Parse a trace CSV (docs/simulation-workloads.md); raises WorkloadError naming the line."""
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise WorkloadError(f"{where}: trace file not found") from None
    except IsADirectoryError:
        raise WorkloadError(f"{where}: is a directory, not a trace file") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise WorkloadError(f"{where}: cannot read the trace: {exc.strerror}") from None
    lines = [
        (number, line)
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not lines:
        raise WorkloadError(f"{where}: empty trace: no header row")
    header_line, header_text = lines[0]
    header = [name.strip() for name in next(csv.reader([header_text]))]
    _check_header(where, header_line, header)
    rows = lines[1:]
    if not rows:
        raise WorkloadError(f"{where}: the trace has a header but no jobs")
    cells: list[list[str]] = [[] for _ in header]
    reader = csv.reader(line for _, line in rows)
    for index, row in enumerate(reader):
        number = rows[index][0]
        if reader.line_num != index + 1:
            raise WorkloadError(f"{where}:{number}: a quoted cell spans lines")
        if len(row) != len(header):
            raise WorkloadError(
                f"{where}:{number}: expected {len(header)} cells ({', '.join(header)}),"
                f" found {len(row)}"
            )
        for column, cell in zip(cells, row, strict=True):
            column.append(cell.strip())
    numbers = [number for number, _ in rows]
    col = {name: cells[i] for i, name in enumerate(header)}
    n = len(rows)

    def numeric(name: str, *, integer: bool, default: float) -> F64:
        if name not in col:
            return np.full(n, default)
        values = _parse_numbers(
            where, name, col[name], numbers, integer=integer, required=name in REQUIRED_COLUMNS
        )
        return np.where(np.isnan(values), default, values)  # NaN only where a cell is empty

    arrival = numeric("arrival_s", integer=False, default=0.0)
    gpus = numeric("gpus", integer=True, default=0.0)
    duration = numeric("duration_s", integer=False, default=0.0)
    cpu = numeric("cpu", integer=True, default=math.nan)
    mem = numeric("mem_gb", integer=False, default=math.nan)
    priority = numeric("priority", integer=True, default=0.0)
    size = numeric("data_size_gb", integer=False, default=0.0)
    for name, values, bad, rule in (
        ("arrival_s", arrival, arrival < 0, ">= 0"),
        ("gpus", gpus, gpus < 0, ">= 0"),
        ("duration_s", duration, duration <= 0, "> 0"),
        ("cpu", cpu, cpu < 0, ">= 0"),
        ("mem_gb", mem, mem < 0, ">= 0"),
        ("data_size_gb", size, size < 0, ">= 0"),
    ):
        if bad.any():
            i = int(np.argmax(bad))
            raise WorkloadError(
                f"{where}:{numbers[i]}: {name}: {col[name][i]!r} must be {rule}"
                if name in col
                else f"{where}:{numbers[i]}: {name}: {values[i]} must be {rule}"
            )
    model, models = _codes(col.get("model"), n, default=None)
    tenant, tenants = _codes(col.get("tenant"), n, default="default")
    region, regions = _codes(col.get("data_region"), n, default=None)
    return Trace(
        path=where,
        arrival_s=arrival,
        gpus=gpus.astype(np.int32),
        duration_s=duration,
        cpu=np.where(np.isnan(cpu), -1, cpu).astype(np.int32),
        mem_gb=mem,
        priority=priority.astype(np.int32),
        data_size_gb=size,
        model=model,
        models=models,
        tenant=tenant,
        tenants=tenants,
        data_region=region,
        regions=regions,
    )


def _check_header(where: str, line: int, header: list[str]) -> None:
    seen: set[str] = set()
    for name in header:
        if name in seen:
            raise WorkloadError(f"{where}:{line}: column {name!r} appears twice")
        seen.add(name)
    known = REQUIRED_COLUMNS + OPTIONAL_COLUMNS
    unknown = [name for name in header if name not in known]
    if unknown:
        hint = ""
        if all(_is_number(name) for name in unknown):
            hint = "; is the header row missing?"
        raise WorkloadError(
            f"{where}:{line}: unknown column(s) {', '.join(map(repr, unknown))}"
            f" (known: {', '.join(known)}){hint}"
        )
    missing = [name for name in REQUIRED_COLUMNS if name not in seen]
    if missing:
        raise WorkloadError(
            f"{where}:{line}: missing required column(s) {', '.join(map(repr, missing))}"
        )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _parse_numbers(
    where: str, name: str, cells: list[str], numbers: list[int], *, integer: bool, required: bool
) -> F64:
    what = "an integer" if integer else "a number"
    if required and not all(cells):
        i = cells.index("")
        raise WorkloadError(f"{where}:{numbers[i]}: {name}: empty, but the column is required")
    try:
        values = np.array([cell or "nan" for cell in cells], dtype=np.float64)
    except ValueError:
        for i, cell in enumerate(cells):
            if cell and not _is_number(cell):
                raise WorkloadError(
                    f"{where}:{numbers[i]}: {name}: {cell!r} is not {what}"
                ) from None
        raise  # every cell parses alone; unreachable
    given = np.array([bool(cell) for cell in cells])
    bad = given & ~np.isfinite(values)
    if integer:
        finite = np.where(np.isfinite(values), values, 0.0)
        bad |= given & ((finite != np.floor(finite)) | (np.abs(finite) > INT32_MAX))
    if bad.any():
        i = int(np.argmax(bad))
        raise WorkloadError(f"{where}:{numbers[i]}: {name}: {cells[i]!r} is not {what}")
    return values


def _codes(cells: list[str] | None, n: int, *, default: str | None) -> tuple[I64, tuple[str, ...]]:
    """Codes into a table of distinct values in order of appearance; -1 where not given."""
    if cells is None:
        if default is None:
            return np.full(n, -1, dtype=np.int64), ()
        return np.zeros(n, dtype=np.int64), (default,)
    table: dict[str, int] = {}
    codes = np.empty(n, dtype=np.int64)
    for i, cell in enumerate(cells):
        value = cell or default
        codes[i] = -1 if value is None else table.setdefault(value, len(table))
    return codes, tuple(table)
