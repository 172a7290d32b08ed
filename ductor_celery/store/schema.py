"""Every ductor table, on one MetaData. All names carry the ``eec_`` prefix.

Partial indexes cover only live rows (open runs, unfolded attempts), so the hot queries stay
small however much history accumulates. Unique keys make idempotency a database fact: one open
run per workflow id, one row per attempt token, one transition per (run, seq).
"""

from __future__ import annotations

import decimal
import json
import re
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

from ..engine.status import OPEN_RUN_STATUSES, RunStatus
from ..values import encode_default

metadata = sa.MetaData()

# A JSON string, or a number written with a positive exponent (json.dumps prints floats from
# 1e16 up as ``1e+16``). Strings come first so that text inside them is never touched.
_STRING_OR_BIG_FLOAT = re.compile(r'"(?:[^"\\]|\\.)*"|(-?\d+(?:\.\d+)?[eE]\+\d+)')


def _float_as_decimal(match: re.Match[str]) -> str:
    number = match.group(1)
    if number is None:
        return match.group(0)
    return format(decimal.Decimal(number), "f") + ".0"


#: Built once: ``json.dumps`` with arguments builds an encoder per call.
_STORE_ENCODER = json.JSONEncoder(separators=(",", ":"), default=encode_default)


def dumps_json(value: Any) -> str:
    """The JSON text ductor stores, the same on every database.

    A float with a positive exponent is written out in full with a trailing ``.0``
    (``1e+16`` -> ``10000000000000000.0``): PostgreSQL's jsonb prints ``1e+16`` back as
    ``10000000000000000``, which would read back as an int. Everything else is ``json.dumps``.
    Values reach it checked (``payloads``), so already in the tagged encoding of
    ``ductor_celery.values``; a typed value that did not is encoded the same way here.
    """
    if value is None:  # most of an outcome's columns
        return "null"
    return stored_json_text(_STORE_ENCODER.encode(value))


def stored_json_text(text: str) -> str:
    """A JSON text with every float of a positive exponent written out in full, as
    ``dumps_json`` stores it (any other JSON encoding of the same value: the text a payload
    check made, ``payloads.JsonCheck.text``)."""
    if "e+" in text or "E+" in text:
        return _STRING_OR_BIG_FLOAT.sub(_float_as_decimal, text)
    return text


class JsonText(sa.types.TypeDecorator[Any]):
    """JSON kept as TEXT on SQLite, so a stored value comes back exactly as it went in.

    A column declared ``JSON`` has NUMERIC affinity in SQLite: a bare number stored in it is
    converted on the way in (``2**64 + 1`` becomes the REAL ``1.8446744073709552e+19``,
    ``1.0`` becomes ``1``, ``-0.0`` becomes ``0``). A TEXT column never converts. Python
    ``None`` is stored as the JSON text ``null``, as SQLAlchemy's ``JSON`` type does.
    """

    impl = sa.Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: sa.Dialect) -> str:
        return dumps_json(value)

    def process_result_value(self, value: Any, dialect: sa.Dialect) -> Any:
        if value is None:
            return None
        if isinstance(value, bytes | str):
            return json.loads(value)
        return value  # a number stored before migration 0005 (already converted by SQLite)


#: JSONB on PostgreSQL, JSON as exact TEXT on SQLite (path expressions such as
#: ``state["context"]`` still compile to ``json_extract`` there).
Json = sa.JSON().with_variant(JSONB(), "postgresql").with_variant(JsonText(), "sqlite")
Ts = sa.DateTime(timezone=True)

#: The predicate of the partial unique index on open runs' workflow ids, made from
#: ``OPEN_RUN_STATUSES`` in the enum's order. Migration 0001 created the index with this very
#: text (tests/integration/test_open_run_index.py checks the migrated databases against it): a
#: change to the open statuses changes the index, and needs a migration of its own.
OPEN_STATUSES_SQL = "status IN ({})".format(
    ", ".join(f"'{s.value}'" for s in RunStatus if s in OPEN_RUN_STATUSES)
)

workflow_definition = sa.Table(
    "eec_workflow_definition",
    metadata,
    sa.Column("spec_hash", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("spec", Json, nullable=False),
    sa.Column("created_at", Ts, nullable=False, server_default=sa.func.now()),
    sa.Index("eec_workflow_definition_name_version", "name", "version"),
)

workflow_run = sa.Table(
    "eec_workflow_run",
    metadata,
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("workflow_id", sa.String(200), nullable=False),
    sa.Column("workflow", sa.String(200), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column(
        "spec_hash",
        sa.String(64),
        sa.ForeignKey("eec_workflow_definition.spec_hash", name="eec_workflow_run_spec_fk"),
        nullable=False,
    ),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("state", Json, nullable=False),
    # Never updated after the insert (store/load.py caches it per process): a run with another
    # input is another run (continue-as-new).
    sa.Column("input", Json, nullable=True),
    sa.Column("output", Json, nullable=True),
    sa.Column("error", Json, nullable=True),
    sa.Column("record_version", sa.Integer, nullable=False, server_default="0"),
    sa.Column("transition_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("parent_run_id", sa.String(64), nullable=True),
    # The parent's node (sub-workflow or child-run scatter) this child run belongs to.
    sa.Column("parent_node", sa.String(200), nullable=True),
    sa.Column("continued_from", sa.String(64), nullable=True),
    sa.Column("continued_to", sa.String(64), nullable=True),
    sa.Column("created_at", Ts, nullable=False, server_default=sa.func.now()),
    sa.Column("updated_at", Ts, nullable=False, server_default=sa.func.now()),
    sa.Column("finished_at", Ts, nullable=True),
    # W3C traceparent of the span that started the run (ductor_celery/tracing.py): its ticks
    # and attempts join that trace. NULL when tracing was off at start.
    sa.Column("trace_context", sa.String(200), nullable=True),
    # 0..9, higher first where work waits (docs/flow-control.md); children inherit it.
    sa.Column("priority", sa.SmallInteger, nullable=False, server_default="0"),
    # One open run per workflow id: starting twice returns the open run.
    sa.Index(
        "eec_workflow_run_open_workflow_id",
        "workflow_id",
        unique=True,
        postgresql_where=sa.text(OPEN_STATUSES_SQL),
        sqlite_where=sa.text(OPEN_STATUSES_SQL),
    ),
    sa.Index("eec_workflow_run_workflow_id_created", "workflow_id", "created_at"),
    sa.Index(
        "eec_workflow_run_parent",
        "parent_run_id",
        postgresql_where=sa.text("parent_run_id IS NOT NULL"),
        sqlite_where=sa.text("parent_run_id IS NOT NULL"),
    ),
    sa.Index("eec_workflow_run_workflow_created", "workflow", "created_at"),
    sa.Index("eec_workflow_run_status_created", "status", "created_at"),
    # The runs list's order and keyset cursor (store/runs.py, list_runs).
    sa.Index("eec_workflow_run_created_run_id", "created_at", "run_id"),
    # Prune reads finished runs by when they finished.
    sa.Index(
        "eec_workflow_run_finished",
        "finished_at",
        postgresql_where=sa.text("finished_at IS NOT NULL"),
        sqlite_where=sa.text("finished_at IS NOT NULL"),
    ),
)

#: The attempt table's generated columns, each the predicate of the partial index of its name
#: (migration 0019 added them; its SQL says the same and must not change with this).
ATTEMPT_PREDICATES = {
    "rate_waiting": "rate_wait_since IS NOT NULL AND finished_at IS NULL",
    "lease_waiting": "lease_key IS NOT NULL AND finished_at IS NULL",
    "unfolded": "finished_at IS NOT NULL AND NOT folded",
}


def _attempt_predicate_index(suffix: str, column: str, *keys: str) -> sa.Index:
    """A partial index of the attempt table on one generated column: true where it holds
    (SQLite's form of it is ``= 1``, the form SQLAlchemy writes a boolean test in there, so
    that its planner matches the two)."""
    return sa.Index(
        f"eec_workflow_step_attempt_{suffix}",
        *keys,
        postgresql_where=sa.text(column),
        sqlite_where=sa.text(f"{column} = 1"),
    )


step_attempt = sa.Table(
    "eec_workflow_step_attempt",
    metadata,
    sa.Column("token", sa.String(300), primary_key=True),
    sa.Column("run_id", sa.String(64), nullable=False),
    sa.Column("node", sa.String(200), nullable=False),
    sa.Column("branch", sa.Integer, nullable=True),
    sa.Column("generation", sa.Integer, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("step", sa.String(200), nullable=False),
    sa.Column("queue", sa.String(200), nullable=True),
    sa.Column("args", Json, nullable=False),
    sa.Column("timeout", sa.Float, nullable=False),
    sa.Column("created_at", Ts, nullable=False, server_default=sa.func.now()),
    sa.Column("claimed_at", Ts, nullable=True),
    sa.Column("claimed_by", sa.String(200), nullable=True),
    # The task id of the Celery message whose worker process runs the attempt (set with the
    # claim): its own token, or the message that began the inline chain it runs in (another
    # step's token, or "<run id>:first_tick"). A terminate or a run deadline revokes it with
    # terminate=True: the only way to kill a step that has no message of its own. A carrier
    # only ever runs attempts of one run (runtime/inline.py).
    sa.Column("carrier", sa.String(300), nullable=True),
    sa.Column("heartbeat_at", Ts, nullable=True),
    # The details of the latest ctx.heartbeat(details), shown by `ductor show`.
    sa.Column("heartbeat_details", Json, nullable=True),
    # Set by the tick that applied a cooperative cancel: the heartbeat and the claim return
    # it (ctx.cancelled, StepCancelled); docs/operations.md, "Cancel and terminate".
    sa.Column("cancel_requested_at", Ts, nullable=True),
    sa.Column("finished_at", Ts, nullable=True),
    # succeeded | failed | cancelled (by the worker: StepCancelled), timed_out | cancelled
    # (closed by the coordinator)
    sa.Column("outcome", sa.String(20), nullable=True),
    sa.Column("output", Json, nullable=True),
    sa.Column("error", Json, nullable=True),
    sa.Column("retryable", sa.Boolean, nullable=True),
    sa.Column("patch", Json, nullable=True),
    # Set by the coordinator in the commit that applied (or ignored) the outcome.
    sa.Column("folded", sa.Boolean, nullable=False, server_default=sa.false()),
    # The concurrency lease the attempt must hold to run (step name + resolved key), and the
    # key's limit as the definition declared it when the attempt was created.
    sa.Column("lease_key", sa.String(500), nullable=True),
    sa.Column("lease_limit", sa.Integer, nullable=True),
    # The rate-limit bucket the attempt takes a token from when claimed (step name + resolved
    # key), N and the period in seconds as declared; rate_wait_since is set while it waits
    # for a token with no message out (docs/flow-control.md).
    sa.Column("rate_key", sa.String(500), nullable=True),
    sa.Column("rate_limit", sa.Integer, nullable=True),
    sa.Column("rate_period", sa.Float, nullable=True),
    sa.Column("rate_wait_since", Ts, nullable=True),
    # Set when the sweeper hands it a token's turn (its message sent): it keeps its place in
    # line until its claim takes the token.
    sa.Column("rate_released_at", Ts, nullable=True),
    # Its run's priority, for the order in which waiting attempts (leases, rate limits) go.
    sa.Column("priority", sa.SmallInteger, nullable=False, server_default="0"),
    # The tags the step set with ctx.tag ({key: value}), written with the outcome; the tick
    # that folds a succeeded outcome applies them to the run (docs/tags.md).
    sa.Column("tags", Json, nullable=True),
    # The seq of the run's transition "pending -> running, attempt N dispatched" of this
    # attempt's node, and of "running -> succeeded, attempt N succeeded", when this row is
    # that transition instead of a row of eec_workflow_transition (at created_at and
    # finished_at: docs/history-in-attempt-rows.md; store/history.py reads both).
    sa.Column("dispatch_seq", sa.Integer, nullable=True),
    sa.Column("success_seq", sa.Integer, nullable=True),
    # The three partial indexes' predicates, computed by the database at every write
    # (ATTEMPT_PREDICATES): an index whose predicate names finished_at or folded makes every
    # finish a full update, with new entries in every index; an inline step's finish changes
    # none of these three, so it is a HOT update (docs/hot-attempt-finish.md).
    *(
        sa.Column(name, sa.Boolean, sa.Computed(expression, persisted=True))
        for name, expression in ATTEMPT_PREDICATES.items()
    ),
    sa.Index("eec_workflow_step_attempt_run_node", "run_id", "node"),
    # Attempts waiting for a rate-limit token, oldest first per key.
    _attempt_predicate_index("rate_wait", "rate_waiting", "rate_key", "created_at"),
    # Attempts with a lease key and open (waiting for a slot, or holding one), oldest first.
    _attempt_predicate_index("lease_wait", "lease_waiting", "lease_key", "created_at"),
    # The loader's and sweeper's view of outcomes waiting to be folded.
    _attempt_predicate_index("unfolded", "unfolded", "run_id"),
)

#: One token bucket per rate-limit key (GCRA): full when ``tat`` is in the past; a claim at
#: ``now`` may take a token when ``tat - (period - period/N) <= now``, and sets
#: ``tat = max(tat, now) + period/N``. No row is the same as a full bucket.
rate_bucket = sa.Table(
    "eec_rate_bucket",
    metadata,
    sa.Column("key", sa.String(500), primary_key=True),
    sa.Column("tat", Ts, nullable=False),
    sa.Column("updated_at", Ts, nullable=False),
)

#: Run concurrency (``RunConcurrency``): one row per run of a limited workflow from its first
#: tick to its end; ``granted_at`` set while it holds one of its key's slots, NULL while it
#: waits ``pending`` (store/run_slots.py).
run_slot = sa.Table(
    "eec_run_slot",
    metadata,
    # The order of arrival in line (a clock can give two runs one time).
    sa.Column(
        "id",
        sa.BigInteger().with_variant(sa.Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    sa.Column("run_id", sa.String(64), nullable=False, unique=True),
    sa.Column("key", sa.String(500), nullable=False),
    # The limit its definition declared: the line moves while fewer runs hold a slot.
    sa.Column("slot_limit", sa.Integer, nullable=False),
    sa.Column("priority", sa.SmallInteger, nullable=False, server_default="0"),
    sa.Column("created_at", Ts, nullable=False),
    sa.Column("granted_at", Ts, nullable=True),
    sa.Index("eec_run_slot_key", "key", "granted_at"),
)

#: Run tags (docs/tags.md): one row per (run, key), the index the lists filter through. The
#: run state holds the same pairs (``RunState.tags``); both are written in one transaction:
#: a start's, a tick's commit (a succeeded step's ``ctx.tag``, a continue-as-new successor's),
#: and prune deletes them with the run.
run_tag = sa.Table(
    "eec_run_tag",
    metadata,
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("key", sa.String(100), primary_key=True),
    sa.Column("value", sa.String(100), nullable=False),
    # A filter on (key, value) is a range scan of this index that yields the run ids itself.
    sa.Index("eec_run_tag_key_value", "key", "value", "run_id"),
)

workflow_transition = sa.Table(
    "eec_workflow_transition",
    metadata,
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("node", sa.String(200), nullable=True),
    sa.Column("from_status", sa.String(20), nullable=True),
    sa.Column("to_status", sa.String(20), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("at", Ts, nullable=False),
)

workflow_outbox = sa.Table(
    "eec_workflow_outbox",
    metadata,
    sa.Column(
        "id",
        sa.BigInteger().with_variant(sa.Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    sa.Column("run_id", sa.String(64), nullable=False),
    # a DispatchKind value (engine/kinds.py)
    sa.Column("kind", sa.String(20), nullable=False),
    sa.Column("task", sa.String(200), nullable=False),
    sa.Column("queue", sa.String(200), nullable=True),
    sa.Column("payload", Json, nullable=False),
    sa.Column("created_at", Ts, nullable=False, server_default=sa.func.now()),
    sa.Index("eec_workflow_outbox_created", "created_at"),
)

workflow_timer = sa.Table(
    "eec_workflow_timer",
    metadata,
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("fire_at", Ts, nullable=False),
    # When the sweeper last woke the run for this timer; throttles repeat wake-ups.
    sa.Column("woken_at", Ts, nullable=True),
    sa.Index("eec_workflow_timer_fire_at", "fire_at"),
)

workflow_signal = sa.Table(
    "eec_workflow_signal",
    metadata,
    sa.Column(
        "id",
        sa.BigInteger().with_variant(sa.Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    # The run the signal was sent to (the newest run of the workflow id at the time).
    sa.Column("run_id", sa.String(64), nullable=False),
    sa.Column("workflow_id", sa.String(200), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("payload", Json, nullable=True),
    sa.Column("idempotency_key", sa.String(200), nullable=True),
    sa.Column("created_at", Ts, nullable=False, server_default=sa.func.now()),
    # Set by the coordinator in the commit that consumed it (applied_to: the node, or NULL
    # when it was ignored because its node was no longer waiting).
    sa.Column("applied_at", Ts, nullable=True),
    sa.Column("applied_to", sa.String(200), nullable=True),
    sa.Column("applied_version", sa.Integer, nullable=True),
    sa.Index(
        "eec_workflow_signal_idempotency",
        "workflow_id",
        "idempotency_key",
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
        sqlite_where=sa.text("idempotency_key IS NOT NULL"),
    ),
    sa.Index(
        "eec_workflow_signal_unapplied",
        "run_id",
        "id",
        postgresql_where=sa.text("applied_at IS NULL"),
        sqlite_where=sa.text("applied_at IS NULL"),
    ),
    # Prune deletes a run's signals by run id.
    sa.Index("eec_workflow_signal_run", "run_id"),
)

workflow_control = sa.Table(
    "eec_workflow_control",
    metadata,
    sa.Column(
        "id",
        sa.BigInteger().with_variant(sa.Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    sa.Column("run_id", sa.String(64), nullable=False),
    # a ControlKind value (engine/kinds.py): pause, resume, cancel, terminate, redrive,
    # continue_as_new
    sa.Column("kind", sa.String(20), nullable=False),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("requested_by", sa.String(200), nullable=True),
    # Where the request came from (an AuditSource: api, cli, web, bulk, schedule, parent); the
    # tick that applies the control copies it, with requested_by, into its audit entry.
    sa.Column("source", sa.String(20), nullable=True),
    sa.Column("input", Json, nullable=True),
    sa.Column("has_input", sa.Boolean, nullable=False, server_default=sa.false()),
    # A redrive from a node: that node (it and everything after it rerun). NULL otherwise.
    sa.Column("node", sa.String(200), nullable=True),
    # A continue-as-new to another definition (version=): the successor's spec. NULL: the
    # run's own definition.
    sa.Column("spec_hash", sa.String(64), nullable=True),
    sa.Column("created_at", Ts, nullable=False, server_default=sa.func.now()),
    sa.Column("handled_at", Ts, nullable=True),
    # a ControlResult (engine/kinds.py): "applied", or "rejected: <why>" when the run's state
    # no longer allowed it
    sa.Column("result", sa.Text, nullable=True),
    sa.Index(
        "eec_workflow_control_unhandled",
        "run_id",
        "id",
        postgresql_where=sa.text("handled_at IS NULL"),
        sqlite_where=sa.text("handled_at IS NULL"),
    ),
    # Prune deletes a run's controls by run id.
    sa.Index("eec_workflow_control_run", "run_id"),
)

concurrency_lease = sa.Table(
    "eec_concurrency_lease",
    metadata,
    # One row per occupied slot: a key has at most ``limit`` rows, slots 0 .. limit-1.
    sa.Column("key", sa.String(500), primary_key=True),
    sa.Column("slot", sa.Integer, primary_key=True),
    # The holder: the attempt that may run while this row exists.
    sa.Column("token", sa.String(300), nullable=False, unique=True),
    sa.Column("run_id", sa.String(64), nullable=False),
    sa.Column("node", sa.String(200), nullable=False),
    sa.Column("granted_at", Ts, nullable=False),
    # When the holder will have been declared lost at the latest (its claim plus its step
    # timeout); the sweeper looks at leases past it and releases those whose holder ended.
    sa.Column("expires_at", Ts, nullable=True),
)

workflow_wake = sa.Table(
    "eec_workflow_wake",
    metadata,
    # A wake-up of the run is queued and its tick has not started yet: workers that finish an
    # attempt meanwhile need not send another (that tick will see their result).
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("requested_at", Ts, nullable=False),
)

workflow_schedule = sa.Table(
    "eec_workflow_schedule",
    metadata,
    # One row per schedule; defining a schedule again with the same name replaces its row.
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("workflow", sa.String(200), nullable=False),
    # Exactly one of cron (with its IANA time zone) and every (seconds) is set.
    sa.Column("cron", sa.String(200), nullable=True),
    sa.Column("every", sa.Float, nullable=True),
    sa.Column("timezone", sa.String(64), nullable=False),
    sa.Column("input", Json, nullable=True),
    # skip | buffer_one | allow: what a fire time does while the previous run is open
    sa.Column("overlap", sa.String(20), nullable=False),
    # Fire times missed (a coordinator down) by more than this many seconds are not fired.
    sa.Column("catchup_window", sa.Float, nullable=False),
    sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
    # The next fire time not handled yet; the sweeper advances it in the transaction that
    # starts that fire time's run, so each fire time is handled once.
    sa.Column("next_fire_at", Ts, nullable=False),
    # buffer_one: a fire time held back while the previous run is open, started when it ends.
    sa.Column("buffered_fire_at", Ts, nullable=True),
    # The workflow id of the newest run this schedule started (the overlap policy's "previous").
    sa.Column("last_workflow_id", sa.String(200), nullable=True),
    sa.Column("created_at", Ts, nullable=False, server_default=sa.func.now()),
    sa.Column("updated_at", Ts, nullable=False, server_default=sa.func.now()),
    sa.Index("eec_workflow_schedule_next_fire", "next_fire_at"),
)

audit = sa.Table(
    "eec_audit",
    metadata,
    # One action that took effect (docs/operations.md, "Who did what"), written in the
    # transaction of what it records; never updated.
    sa.Column(
        "id",
        sa.BigInteger().with_variant(sa.Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    sa.Column("at", Ts, nullable=False, server_default=sa.func.now()),
    sa.Column("actor", sa.String(200), nullable=True),
    # an AuditAction (engine/kinds.py)
    sa.Column("action", sa.String(20), nullable=False),
    sa.Column("run_id", sa.String(64), nullable=True),
    sa.Column("workflow_id", sa.String(200), nullable=True),
    sa.Column("node", sa.String(200), nullable=True),
    sa.Column("detail", Json, nullable=True),
    # an AuditSource (engine/kinds.py)
    sa.Column("source", sa.String(20), nullable=False),
    # A run's entries (the run page, audit(target)), and prune's deletes by run id.
    sa.Index("eec_audit_run", "run_id", "id"),
    sa.Index("eec_audit_workflow_id", "workflow_id", "id"),
    # Newest first over everything, and retention's delete by age.
    sa.Index("eec_audit_at", "at"),
)

start_request = sa.Table(
    "eec_start_request",
    metadata,
    # One request from outside that must take effect once however often it is sent
    # (store/start_requests.py): an HTTP start with an ``Idempotency-Key`` (scope
    # ``api:<workflow>``) or a webhook's delivery (scope ``hook:<name>``; the key is the value
    # at the hook's workflow id path, or the SHA-256 of the body). Inserted in the transaction
    # that inserts the run (or the signal) it started, never updated; pruned with that run.
    # The scope holds "hook:" and a name of up to 200 characters.
    sa.Column("scope", sa.String(210), primary_key=True),
    sa.Column("key", sa.String(200), primary_key=True),
    # The run it started, or (a signal hook) the run its signal went to.
    sa.Column("run_id", sa.String(64), nullable=False),
    sa.Column("workflow_id", sa.String(200), nullable=False),
    # A signal hook's delivery: the signal row it inserted. NULL for a start.
    sa.Column("signal_id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), nullable=True),
    sa.Column("created_at", Ts, nullable=False, server_default=sa.func.now()),
    # Prune deletes a run's requests by run id.
    sa.Index("eec_start_request_run", "run_id"),
)

#: Large values by reference (docs/large-values.md): a value over ``ductor_offload_bytes`` is
#: stored here once, cut into chunks (1 MiB slices of its text; a list's whole items, up to
#: 256 KiB a chunk), and the row that would have held it holds a reference
#: (``blobrefs.BlobRef``). Written in the transaction of the row that refers to it (the
#: client's insert, the tick's commit), except a step's result: the step worker writes its
#: blob in a short transaction of its own just before the outcome's. Never updated; prune
#: deletes a run's blobs with it.
blob = sa.Table(
    "eec_blob",
    metadata,
    # 32 hex characters, random: a reference names its blob, never a value its content.
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    # The run whose row first held the value: prune deletes by it.
    sa.Column("run_id", sa.String(64), nullable=False),
    # An offloaded list: the index of the chunk's first item (each chunk holds whole items,
    # so a scatter reads the page it dispatches). NULL: a slice of the value's JSON text.
    sa.Column("first_item", sa.Integer, nullable=True),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Index("eec_blob_run", "run_id"),
)
