"""Run and node statuses, attempt outcomes, their groups, and the allowed node transitions.

The groups are the one spelling of "open" and "terminal" everywhere: the engine, the client,
the store's queries and the schema's partial index (``store/schema.py``, ``OPEN_STATUSES_SQL``).
Each enum is a ``str``: a row read back (a plain string) compares equal to its member.
"""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """The status of a run (``eec_workflow_run.status``, stored as its value)."""

    PENDING = "pending"  #: inserted by a client, not ticked yet
    RUNNING = "running"  #: the coordinator is driving it
    PAUSED = "paused"  #: nothing new is dispatched until resumed
    SUCCEEDED = "succeeded"  #: every node finished; output computed
    FAILED = "failed"  #: a node failed without continue_on_failure
    CANCELLED = "cancelled"  #: an operator cancelled it
    TERMINATED = "terminated"  #: an operator terminated it
    CONTINUED = "continued"  #: closed in favour of a successor run
    TIMED_OUT = "timed_out"  #: its deadline (``start(deadline=...)``) passed before it finished


class NodeStatus(StrEnum):
    """The status of a node within one run (kept in the run's state)."""

    PENDING = "pending"  #: not reached yet
    RUNNING = "running"  #: an attempt is in flight or a retry timer is pending
    WAITING = "waiting"  #: parked on external input (signal, approval, timer, child)
    SUCCEEDED = "succeeded"  #: finished with an output
    FAILED = "failed"  #: retry budget spent or non-retryable error
    SKIPPED = "skipped"  #: `when` was falsy or every dependency was skipped
    CANCELLED = "cancelled"  #: the run ended while this node was in flight


#: Run statuses a run never leaves by itself: only a redrive reopens a failed, cancelled,
#: terminated or timed-out run. A tick of a terminal run applies its control, if any, and
#: nothing else.
TERMINAL_RUN_STATUSES: frozenset[RunStatus] = frozenset(
    {
        RunStatus.SUCCEEDED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
        RunStatus.TERMINATED,
        RunStatus.CONTINUED,
        RunStatus.TIMED_OUT,
    }
)
#: Run statuses of a run still in progress: pending, running, paused. At most one run per
#: workflow id is open (a partial unique index), and only an open run takes signals.
OPEN_RUN_STATUSES: frozenset[RunStatus] = frozenset(RunStatus) - TERMINAL_RUN_STATUSES

#: What a parent reads as the status of a child run whose row does not exist
#: (``ChildSnapshot.status``): never stored, so not a ``RunStatus``.
CHILD_MISSING = "missing"

#: Child statuses that end the parent's wait with a failure: every terminal status but
#: succeeded (a child that continued as new is followed to its successor), and a child that
#: could not be started (``CHILD_MISSING``).
FAILED_CHILD_STATUSES: frozenset[str] = frozenset(
    TERMINAL_RUN_STATUSES - {RunStatus.SUCCEEDED, RunStatus.CONTINUED}
) | {CHILD_MISSING}

#: Node statuses after which the node never changes again within one run generation.
FINISHED_NODE_STATUSES: frozenset[NodeStatus] = frozenset(
    {NodeStatus.SUCCEEDED, NodeStatus.FAILED, NodeStatus.SKIPPED, NodeStatus.CANCELLED}
)

#: The statuses a node may move to from each status (``TickContext.move_node`` checks it).
NODE_TRANSITIONS: dict[NodeStatus, frozenset[NodeStatus]] = {
    NodeStatus.PENDING: frozenset(
        # failed: the node cannot start (its resolved arguments are too large)
        {NodeStatus.RUNNING, NodeStatus.SKIPPED, NodeStatus.WAITING, NodeStatus.FAILED}
    ),
    NodeStatus.RUNNING: frozenset(
        {NodeStatus.RUNNING, NodeStatus.SUCCEEDED, NodeStatus.FAILED, NodeStatus.CANCELLED}
    ),
    NodeStatus.WAITING: frozenset({NodeStatus.SUCCEEDED, NodeStatus.FAILED, NodeStatus.CANCELLED}),
    NodeStatus.SUCCEEDED: frozenset(),
    NodeStatus.FAILED: frozenset(),
    NodeStatus.SKIPPED: frozenset(),
    NodeStatus.CANCELLED: frozenset(),
}


class AttemptOutcome(StrEnum):
    """How an attempt ended (``eec_workflow_step_attempt.outcome``, stored as its value; NULL
    while the attempt is queued or running)."""

    SUCCEEDED = "succeeded"  #: the worker wrote the step's output (and context patch, tags)
    FAILED = "failed"  #: the worker wrote the step's error, retryable or not
    #: The step stopped on a cancel (its worker wrote it), or the coordinator closed the
    #: attempt with its node (a cancel, a scatter's failure policy).
    CANCELLED = "cancelled"
    #: The coordinator closed it: it ran past its timeout, or its worker went silent.
    TIMED_OUT = "timed_out"


#: Outcomes a step worker writes (``store/attempts.py``, ``finish``).
WRITTEN_BY_WORKER: frozenset[AttemptOutcome] = frozenset(
    {AttemptOutcome.SUCCEEDED, AttemptOutcome.FAILED, AttemptOutcome.CANCELLED}
)
#: Outcomes the coordinator writes when it closes an attempt itself (``ClosedAttempt``).
CLOSED_BY_COORDINATOR: frozenset[AttemptOutcome] = frozenset(
    {AttemptOutcome.CANCELLED, AttemptOutcome.TIMED_OUT}
)
#: Outcomes of a step that ran to its end: the row's output column holds what it returned
#: (a batch's recorded items when it failed). Any other outcome's output column may hold its
#: worker's last checkpoint, which the tick never counted, so no gather counts it either.
RAN_TO_END: frozenset[AttemptOutcome] = frozenset({AttemptOutcome.SUCCEEDED, AttemptOutcome.FAILED})
