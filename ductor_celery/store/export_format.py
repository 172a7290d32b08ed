"""A run as one JSON document, format 1 (docs/replay.md): writing it, and reading it back.

``export_document(engine, run_id, tags)`` builds the document from the store
(``store/exports.py`` reads the rows); ``read_export(file)`` checks a document and returns it
with its rows in the store's form again (``ExportedRun``), for ``testing.replay`` and
``testing.harness(..., from_export=...)``. Every problem with a file is one ``ExportError``
that names it.

Values are copied as the database holds them (ductor's tagged encoding, secret references,
redactions): nothing is decoded on the way out or encoded on the way back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from ..definition.spec import WorkflowSpec
from ..engine.state import RunState
from ..engine.status import AttemptOutcome, RunStatus
from ..errors import ExportError, RunNotFound
from . import clock
from .exports import (
    ATTEMPT_COLUMNS,
    CONTROL_COLUMNS,
    DEFINITION_COLUMNS,
    LATER_COLUMNS,
    RUN_COLUMNS,
    SIGNAL_COLUMNS,
    TIME_COLUMNS,
    TRANSITION_COLUMNS,
    RunRows,
    read_rows,
)
from .inputs import input_for_view

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_KIND",
    "ExportError",
    "ExportedRun",
    "dumps_export",
    "export_document",
    "read_export",
]

#: The version of the document ``export_document`` writes and ``read_export`` reads.
EXPORT_FORMAT = 1
#: The ``kind`` key: what tells an export from any other JSON file.
EXPORT_KIND = "ductor-run-export"

#: Each list section of format 1 and the columns every one of its entries must hold.
_SECTIONS: dict[str, tuple[str, ...]] = {
    "attempts": ATTEMPT_COLUMNS,
    "signals": SIGNAL_COLUMNS,
    "controls": CONTROL_COLUMNS,
    "transitions": TRANSITION_COLUMNS,
}


@dataclass(frozen=True, slots=True)
class ExportedRun:
    """A checked export: the document as read, and its rows in the store's form."""

    #: Where it came from, for messages ("run.json", or "the export" for a dict).
    source: str
    document: dict[str, Any]
    rows: RunRows
    exported_at: datetime

    @property
    def run_id(self) -> str:
        return str(self.rows.run["run_id"])


# -- writing ------------------------------------------------------------------------------------


def _wire(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def _wire_row(row: dict[str, Any]) -> dict[str, Any]:
    return {name: _wire(value) for name, value in row.items()}


def export_document(engine: Engine, run_id: str, tags: dict[str, str]) -> dict[str, Any]:
    """The export (format 1) of run ``run_id`` (``RunNotFound`` if there is none); ``tags``:
    the run's tags as its view has them."""
    rows = read_rows(engine, run_id)
    if rows is None:
        raise RunNotFound(f"no run with run id {run_id!r}")
    state = RunState.from_json(rows.run["state"])
    return {
        "format": EXPORT_FORMAT,
        "kind": EXPORT_KIND,
        "exported_at": clock.now(engine).isoformat(),
        "run": _wire_row(rows.run),
        "definition": _wire_row(rows.definition),
        "input": input_for_view(engine, state, rows.run["input"]),
        "context": state.context,
        "attempts": [_wire_row(a) for a in rows.attempts],
        "signals": [_wire_row(s) for s in rows.signals],
        "controls": [_wire_row(c) for c in rows.controls],
        "transitions": [_wire_row(t) for t in rows.transitions],
        "timer": _wire(rows.timer),
        "tags": dict(tags),
    }


def dumps_export(document: dict[str, Any]) -> str:
    """The document as text: indented, keys in the order written (values are JSON already:
    the database's own)."""
    return json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False)


# -- reading ------------------------------------------------------------------------------------


def read_export(file: str | os.PathLike[str] | dict[str, Any]) -> ExportedRun:
    """The export in ``file`` (a path, or the document as a dict), checked: one
    ``ExportError`` naming the problem if it is not an export of format 1."""
    if isinstance(file, dict):
        source, document = "the export", file
    else:
        source = str(file)
        document = _load(Path(file), source)
    if not isinstance(document, dict) or document.get("kind") != EXPORT_KIND:
        raise ExportError(
            f'{source} is not a ductor run export (no "kind": "{EXPORT_KIND}"; '
            "write one with 'ductor -A app export TARGET')"
        )
    found = document.get("format")
    if found != EXPORT_FORMAT or isinstance(found, bool):
        raise ExportError(
            f"{source} is an export of format {found!r}; this ductor reads format "
            f"{EXPORT_FORMAT} (export the run again with this version)"
        )
    return _checked(source, document)


def _load(path: Path, source: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ExportError(f"{source} is not a ductor run export (no such file)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ExportError(f"{source} is not a ductor run export ({exc})") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ExportError(f"{source} is not a ductor run export (not JSON: {exc})") from None


def _incomplete(source: str, what: str) -> ExportError:
    return ExportError(f"{source} is not a complete export of format {EXPORT_FORMAT}: {what}")


def _object(source: str, document: dict[str, Any], key: str, columns: tuple[str, ...]) -> Any:
    value = document.get(key)
    if not isinstance(value, dict):
        raise _incomplete(source, f"{key!r} must be an object")
    missing = [c for c in columns if c not in value]
    if missing:
        raise _incomplete(source, f"{key!r} lacks {', '.join(missing)}")
    return _store_row(source, key, value, columns)


def _store_row(
    source: str, where: str, row: dict[str, Any], columns: tuple[str, ...]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in columns:
        value = row.get(name) if name in LATER_COLUMNS else row[name]
        if name in TIME_COLUMNS and value is not None:
            value = _time(source, f"{where} {name}", value)
        out[name] = value
    return out


def _time(source: str, where: str, value: Any) -> datetime:
    try:
        found = datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        found = None
    if found is None or found.tzinfo is None:
        raise _incomplete(source, f"{where} must be an ISO 8601 time with its offset")
    return found


#: The types replay and restore rely on, per list section (JSON's own: no bool for an int).
_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "attempts": {
        "token": (str,),
        "node": (str,),
        "step": (str,),
        "branch": (int, type(None)),
        "generation": (int,),
        "attempt": (int,),
        "args": (dict,),
    },
    "signals": {"id": (int,), "name": (str,)},
    "controls": {"id": (int,), "kind": (str,)},
    "transitions": {"seq": (int,), "to_status": (str,)},
}


#: The run row's columns a restore writes as they are, and what each must be.
_RUN_TYPES: dict[str, tuple[type, ...]] = {
    "run_id": (str,),
    "workflow_id": (str,),
    "status": (str,),
    "record_version": (int,),
    "transition_count": (int,),
    "priority": (int,),
}

#: What an attempt row's ``outcome`` may hold: written by the worker (succeeded, failed,
#: cancelled by StepCancelled) or by a tick that closed it (timed_out, cancelled).
_ATTEMPT_OUTCOMES: frozenset[str | None] = frozenset({None, *AttemptOutcome})


def _type_problem(entry: dict[str, Any], types: dict[str, tuple[type, ...]]) -> str | None:
    for name, allowed in types.items():
        value = entry[name]
        if isinstance(value, bool) or not isinstance(value, allowed):
            wanted = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            return f"{name} must be {wanted}, got {type(value).__name__}"
    return None


def _outcome_problem(outcome: Any) -> str | None:
    if outcome is None or (isinstance(outcome, str) and outcome in _ATTEMPT_OUTCOMES):
        return None
    return f"outcome {str(outcome)[:40]!r} is not an attempt outcome"


def _step_problem(spec: WorkflowSpec, attempt: dict[str, Any]) -> str | None:
    """An attempt of a node the run's definition lacks, or that ran another step than the
    node's: the file was edited (a run's definition is pinned), and replay would call the
    wrong function."""
    node = attempt["node"]
    declared = spec.graph.declared(node)
    expected = getattr(declared, "step", None)
    if expected is None:
        return f"node {node[:100]!r} is not a step node of the run's definition"
    if attempt["step"] != expected:
        return (
            f"step {attempt['step'][:100]!r} is not the step of node {node[:100]!r} "
            f"in the run's definition ({expected!r})"
        )
    return None


def _run_problem(run: dict[str, Any]) -> str | None:
    """What is wrong with the run row's columns a restore writes unchecked, or None."""
    problem = _type_problem(run, _RUN_TYPES)
    if problem is not None:
        return f"the run's {problem}"
    if run["status"] not in {s.value for s in RunStatus}:
        return f"the run's status {run['status'][:40]!r} is not a run status"
    return None


def _checked(source: str, document: dict[str, Any]) -> ExportedRun:
    run = _object(source, document, "run", RUN_COLUMNS)
    definition = _object(source, document, "definition", DEFINITION_COLUMNS)
    if run["spec_hash"] != definition["spec_hash"]:
        raise _incomplete(source, "the run's spec_hash is not its definition's")
    try:
        RunState.from_json(run["state"])
    except Exception as exc:  # noqa: BLE001 - whatever a hand-edited state breaks
        raise _incomplete(source, f"the run's state does not read ({exc})") from None
    try:
        spec = WorkflowSpec.model_validate(definition["spec"])
    except Exception as exc:  # noqa: BLE001 - pydantic's error, or a TypeError from a validator
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _incomplete(source, f"the definition's spec does not read ({first})") from None
    problem = _run_problem(run)
    if problem is not None:
        raise _incomplete(source, problem)
    sections: dict[str, list[dict[str, Any]]] = {}
    for key, columns in _SECTIONS.items():
        entries = document.get(key)
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise _incomplete(source, f"{key!r} must be a list of objects")
        rows = []
        for index, entry in enumerate(entries):
            missing = [c for c in columns if c not in entry and c not in LATER_COLUMNS]
            if missing:
                raise _incomplete(source, f"{key}[{index}] lacks {', '.join(missing)}")
            problem = _type_problem(entry, _TYPES.get(key, {}))
            if key == "attempts" and problem is None:
                problem = _outcome_problem(entry["outcome"]) or _step_problem(spec, entry)
            if problem is not None:
                raise _incomplete(source, f"{key}[{index}] {problem}")
            rows.append(_store_row(source, f"{key}[{index}]", entry, columns))
        sections[key] = rows
    timer = document.get("timer")
    for key in ("exported_at", "input", "context"):
        if key not in document:
            raise _incomplete(source, f"{key!r} is missing")
    if not isinstance(document["context"], dict):
        raise _incomplete(source, "'context' must be an object")
    return ExportedRun(
        source=source,
        document=document,
        rows=RunRows(
            run=run,
            definition=definition,
            attempts=sections["attempts"],
            signals=sections["signals"],
            controls=sections["controls"],
            transitions=sections["transitions"],
            timer=None if timer is None else _time(source, "timer", timer),
        ),
        exported_at=_time(source, "exported_at", document["exported_at"]),
    )
