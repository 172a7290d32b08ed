"""Phase 2: drive fan-out. Start scatter branches up to ``max_parallel``, count finished ones,
apply the failure policy, and gather.

A scatter's state is counters plus the branches in flight (``ScatterState``), so the run row
stays small however many items there are. Branch outputs stay in attempt rows; when every
branch has finished the scatter is marked ``gathering`` and wakes its run, and the next load
reads the gathered list (``TickInputs.gathered``) in item order.

With ``batch_size`` > 1 each branch is a batch of consecutive items run as one attempt; the
counters and the failure policy still count items.

See docs/fan-out.md for the states and transitions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..definition.blobrefs import BlobRef, BlobValues, ref_of
from ..definition.paths import Scope, item_resolver, resolve
from ..definition.spec import BATCH_ARG, ChildScatterNodeSpec, ScatterNodeSpec
from ..payloads import check_json, refusal, refusal_error
from . import children
from .context import TickContext
from .inputs import ClosedAttempt, Dispatch
from .kinds import DispatchKind
from .slots import Slot, lease_key_for, rate_key_for, start_attempt
from .state import BranchState, ScatterState
from .status import OPEN_RUN_STATUSES, RAN_TO_END, AttemptOutcome, NodeStatus, RunStatus

AnyScatter = ScatterNodeSpec | ChildScatterNodeSpec


def _active_status(spec: AnyScatter) -> NodeStatus:
    """Inline branches run (``running``); a node waiting on child runs is parked (``waiting``)."""
    return NodeStatus.RUNNING if isinstance(spec, ScatterNodeSpec) else NodeStatus.WAITING


def start_scatter(t: TickContext, node_id: str, spec: AnyScatter, scope: Scope) -> None:
    """A ready scatter node reads its item list and starts its first branches."""
    ns = t.nodes[node_id]
    items = _items_of(resolve(spec.over, scope), t.blobs)
    ns.started_at = t.now
    if not isinstance(items, list | PagedItems):
        kind = "a large value" if ref_of(items) is not None else type(items).__name__
        ns.error = {
            "type": "InvalidScatter",
            "message": f"over={spec.over!r} resolved to {kind}, not a list",
        }
        ns.finished_at = t.now
        t.move_node(node_id, NodeStatus.FAILED, ns.error["message"])
        return
    if isinstance(spec, ChildScatterNodeSpec):
        ns.generation += 1  # child run ids are made from it: a redrive starts new children
    batch = spec.batch_size if isinstance(spec, ScatterNodeSpec) else 1
    ns.work = ScatterState(run=t.inputs.run_id, base=ns.generation, total=len(items), batch=batch)
    if isinstance(spec, ChildScatterNodeSpec):
        children.poll_later(t, node_id)
    what = "items" if isinstance(spec, ScatterNodeSpec) else f"child runs of {spec.workflow!r}"
    at_once = f"{spec.max_parallel} batches of {batch}" if batch > 1 else str(spec.max_parallel)
    t.move_node(
        node_id,
        _active_status(spec),
        f"scatter over {len(items)} {what}, at most {at_once} at once",
    )
    if not items:
        ns.finished_at = t.now
        t.outputs[node_id] = []
        t.move_node(node_id, NodeStatus.SUCCEEDED, "scatter over an empty list: output []")
        return
    _fill(t, node_id, spec, items, scope)


def drive_scatters(t: TickContext) -> bool:
    """Start branches where there is room, finish gathers that were read. True if a node
    finished (its dependants may be ready)."""
    finished = False
    scope: Scope | None = None
    for node_id in t.spec.graph.scatters:
        ns = t.nodes[node_id]
        sc = ns.scatter
        spec = t.spec.graph.nodes[node_id]
        if sc is None or not isinstance(spec, AnyScatter) or ns.status != _active_status(spec):
            continue
        if sc.gathering:
            if node_id in t.inputs.gathered:
                _gathered(t, node_id, sc, t.inputs.gathered[node_id])
                finished = True
            continue
        if isinstance(spec, ChildScatterNodeSpec):
            _fold_children(t, node_id, sc)
            if ns.status == NodeStatus.WAITING:
                children.poll_due(t, node_id)
        active = ns.status == _active_status(spec)
        if active and sc.next < sc.total and len(sc.branches) < spec.max_parallel:
            if scope is None:
                scope = _scope(t)
            items = _items_of(resolve(spec.over, scope), t.blobs)
            if not isinstance(items, list | PagedItems) or len(items) != sc.total:
                # ``over`` reads the input or a finished node's output, which never change;
                # seeing anything else means the stored state is damaged: fail, never guess.
                _fail_node(t, node_id, "the scatter's item list changed while it ran")
                finished = True
                continue
            _fill(t, node_id, spec, items, scope)
        if ns.status == _active_status(spec) and sc.next >= sc.total and not sc.branches:
            sc.gathering = True
            # The gather is read by the next load: wake the run now rather than at a timer.
            t.payload.dispatches.append(
                Dispatch(DispatchKind.WAKEUP, t.inputs.run_id, node_id, "", "", None)
            )
            t.record(
                node_id,
                ns.status,
                ns.status,
                f"all {sc.total} branches finished ({sc.failed} failed): gathering",
            )
        finished = finished or ns.status != _active_status(spec)
    return finished


def _fold_children(t: TickContext, node_id: str, sc: ScatterState) -> None:
    """Count the child runs in flight that have finished, by their snapshots."""
    for index, branch in sorted(sc.branches.items()):
        snap = t.inputs.children.get(branch.token or "")
        if snap is None or snap.status in OPEN_RUN_STATUSES:
            continue
        if snap.status == RunStatus.SUCCEEDED:
            branch_succeeded(t, node_id, index)
        else:
            branch_failed(t, node_id, index, children.child_error(snap), "child run ended")
        if t.nodes[node_id].status != NodeStatus.WAITING:
            return  # the failure policy stopped the scatter


def _scope(t: TickContext) -> Scope:
    return Scope(
        input=t.inputs.input, context=t.payload.state.context, outputs=t.outputs, blobs=t.blobs
    )


class PagedItems:
    """A scatter's item list offloaded to a blob (docs/large-values.md): its length is in the
    reference, and its items come from the pages the load read for the items this tick
    dispatches, never the whole list."""

    __slots__ = ("ref", "blobs", "_page")

    def __init__(self, ref: BlobRef, blobs: BlobValues) -> None:
        self.ref = ref
        self.blobs = blobs
        self._page: Mapping[int, Any] = {}

    def __len__(self) -> int:
        return self.ref.items or 0

    def ready(self, start: int, stop: int) -> bool:
        """Whether items ``start..stop-1`` were read (if not, the page is needed)."""
        page = self.blobs.page(self.ref, start, stop)
        if page is None:
            return False
        self._page = page
        return True

    def __getitem__(self, index: int) -> Any:
        return self._page[index]


Items = list[Any] | PagedItems


def _items_of(value: Any, blobs: BlobValues) -> Any:
    """``over``'s value: a list, an offloaded list's pages, or anything else (refused)."""
    ref = ref_of(value)
    if ref is not None and ref.items is not None:
        return PagedItems(ref, blobs)
    return value


def _fill(t: TickContext, node_id: str, spec: AnyScatter, items: Items, scope: Scope) -> None:
    ns = t.nodes[node_id]
    sc = ns.scatter
    assert sc is not None
    limit = t.inputs.config.max_payload_bytes
    end = sc.total
    if isinstance(items, PagedItems):
        if node_id in t.page_due:
            return  # its page ran out in this computation: the next tick reads the next one
        # Only the items this tick may dispatch: at most max_parallel branches of batch items.
        room = max(spec.max_parallel - len(sc.branches), 0) * sc.batch
        end = min(sc.total, sc.next + room)
        if not items.ready(sc.next, end):
            return  # needed: the tick is computed again with that page
        # A refused branch takes no place in ``branches``, so the loop would run past the page
        # it read: it stops at the page's end, and the run's next tick is due at once for the
        # next page (``TickContext.page_due``), not another read round in this tick.
    while sc.next < end and len(sc.branches) < spec.max_parallel:
        if ns.status != _active_status(spec):
            return  # the failure policy stopped the scatter (a refused branch)
        if sc.batch > 1:
            assert isinstance(spec, ScatterNodeSpec)
            _start_batch(t, node_id, spec, items, scope)
            continue
        index = sc.next
        sc.next += 1
        item_scope = _item_scope(scope, items[index])
        if isinstance(spec, ChildScatterNodeSpec):
            child, refused = children.start_child(
                t, node_id, spec, resolve(spec.input, item_scope), index, sc.base, owner=sc.run
            )
            if child is None:
                assert refused is not None
                sc.errors[index] = refused
                branch_failed(t, node_id, index, refused, "child input refused")
            else:
                sc.branches[index] = BranchState(token=child)
            continue
        checked = check_json(
            resolve(spec.branch_args(), item_scope), f"branch {index} arguments", limit
        )
        error = refusal_error(checked)
        if error is not None:
            # No attempt row holds this failure, so the state keeps it for the gather.
            sc.errors[index] = error
            branch_failed(t, node_id, index, error, "arguments refused")
            continue
        branch = BranchState()
        sc.branches[index] = branch
        start_attempt(
            t,
            node_id,
            checked.value,
            lease_key=lease_key_for(spec, item_scope),
            branch=index,
            slot=branch,
            rate_key=rate_key_for(spec, item_scope),
            args_text=checked.text,
        )
    if (
        isinstance(items, PagedItems)
        and ns.status == _active_status(spec)
        and sc.next < sc.total
        and len(sc.branches) < spec.max_parallel
    ):
        t.page_due.add(node_id)
    t.payload.changed = True


def _start_batch(
    t: TickContext, node_id: str, spec: ScatterNodeSpec, items: Items, scope: Scope
) -> None:
    """Start the next batch: one attempt whose arguments are each item's resolved arguments.

    Each item's arguments are held to the payload limit as an unbatched branch's are: the
    batch's list is checked once, and only a list refused is checked item by item; an item
    refused there fails alone, and its place in the batch is ``None`` (the worker skips it).
    The retry copies these arguments, ``base`` included, so every attempt of the batch finds
    the earlier ones' recorded outputs.
    """
    ns = t.nodes[node_id]
    sc = ns.scatter
    assert sc is not None
    limit = t.inputs.config.max_payload_bytes
    branch = sc.next // sc.batch
    span = sc.batch_items(branch)
    sc.next = span.stop
    template = spec.branch_args()
    of_item = item_resolver(template, scope)
    resolved = [of_item(items[index]) for index in span]
    # The batch's arguments checked as one value first: each item's text is a part of the
    # list's, so a list within the limit (and storable) has every item within it. Only a
    # refused list is checked item by item, to find and name the items refused.
    whole, problem = refusal(resolved, f"batch {branch} arguments", limit)
    if problem is None:
        _start_batch_attempt(t, node_id, spec, scope, items, span, whole)
        return
    per_item: list[dict[str, Any] | None] = []
    for index, args in zip(span, resolved, strict=True):
        args, error = refusal(args, f"item {index} arguments", limit)
        if error is None:
            per_item.append(args)
            continue
        sc.errors[index] = error
        per_item.append(None)
        _items_failed(t, node_id, 1, error, f"item {index}", "arguments refused")
        if ns.status != NodeStatus.RUNNING:
            return
    if all(a is None for a in per_item):
        return
    _start_batch_attempt(t, node_id, spec, scope, items, span, per_item)


def _start_batch_attempt(
    t: TickContext,
    node_id: str,
    spec: ScatterNodeSpec,
    scope: Scope,
    items: Items,
    span: range,
    per_item: list[dict[str, Any] | None],
) -> None:
    """The batch's attempt, with each item's checked arguments (``None``: refused)."""
    sc = t.nodes[node_id].scatter
    assert sc is not None
    branch = span.start // sc.batch
    slot = BranchState()
    sc.branches[branch] = slot
    batch_args = {BATCH_ARG: {"base": sc.base, "first": span.start, "items": per_item}}
    first = next(i for i, a in zip(span, per_item, strict=True) if a is not None)
    start_attempt(
        t,
        node_id,
        batch_args,
        # One lease for the batch: the builder refuses keys that read $.item when batched.
        lease_key=lease_key_for(spec, _item_scope(scope, items[first])),
        branch=branch,
        slot=slot,
        # One token for the batch: likewise, a rate key reading $.item is refused.
        rate_key=rate_key_for(spec, _item_scope(scope, items[first])),
    )


def _item_scope(scope: Scope, item: Any) -> Scope:
    return Scope(
        input=scope.input,
        context=scope.context,
        outputs=scope.outputs,
        item=item,
        blobs=scope.blobs,
    )


def _runnable(sc: ScatterState, branch: int) -> int:
    """How many items of a branch its attempts run (those not refused before it started)."""
    return sum(1 for i in sc.batch_items(branch) if i not in sc.errors)


def batch_shape_problem(sc: ScatterState, branch: int, output: Any) -> str | None:
    """A batch's successful result must hold one value per item of the batch."""
    size = len(sc.batch_items(branch))
    if isinstance(output, list) and len(output) == size:
        return None
    got = f"a list of {len(output)}" if isinstance(output, list) else type(output).__name__
    return f"batch {branch} result must be a list of {size} item outputs, got {got}"


def note_batch_progress(slot: BranchState, output: Any) -> None:
    """A failed batch attempt reports the items with a recorded output (``{"done": ...}``,
    earlier attempts' included); if the batch gives up, they count as succeeded."""
    done = output.get("done") if isinstance(output, dict) else None
    if isinstance(done, dict):
        slot.done = max(slot.done, len(done))


def branch_succeeded(t: TickContext, node_id: str, branch: int) -> None:
    sc = t.nodes[node_id].scatter
    assert sc is not None
    sc.branches.pop(branch, None)
    sc.succeeded += _runnable(sc, branch) if sc.batch > 1 else 1
    t.payload.changed = True


def branch_failed(
    t: TickContext, node_id: str, branch: int, error: dict[str, Any], why: str
) -> None:
    """A branch gave up. Within the tolerance the scatter goes on; past it, it fails fast:
    nothing more is started and the branches in flight are revoked and closed.

    A batch that gives up counts its items with a recorded output as succeeded and the rest
    as failed."""
    sc = t.nodes[node_id].scatter
    assert sc is not None
    slot = sc.branches.pop(branch, None)
    if sc.batch == 1:
        _items_failed(t, node_id, 1, error, f"branch {branch}", why, branch=branch)
        return
    span = sc.batch_items(branch)
    runnable = _runnable(sc, branch)
    done = min(slot.done if slot is not None else 0, runnable)
    sc.succeeded += done
    subject = f"batch {branch} (items {span.start}..{span.stop - 1})"
    if done:
        why = f"{why}, {done} of its {runnable} items done"
    _items_failed(t, node_id, runnable - done, error, subject, why, branch=branch)


def _items_failed(
    t: TickContext,
    node_id: str,
    count: int,
    error: dict[str, Any],
    subject: str,
    why: str,
    branch: int | None = None,
) -> None:
    """``count`` items (branches) failed for good: apply the failure policy to them.

    ``subject`` names what failed ("branch 3", "batch 2 (items 20..29)", "item 7") for the
    history and the node's error."""
    ns = t.nodes[node_id]
    sc = ns.scatter
    assert sc is not None
    spec = t.spec.graph.nodes[node_id]
    assert isinstance(spec, AnyScatter)
    sc.failed += count
    t.payload.changed = True
    message = str(error.get("message", ""))
    allowed = spec.allowed_failures(sc.total)
    if sc.failed <= allowed:
        t.record(
            node_id,
            ns.status,
            ns.status,
            f"{subject} {why}: {message} ({sc.failed} of {allowed} tolerated failures)",
        )
        return
    ns.error = {"type": "BranchFailed", "message": f"{subject} failed: {message}"}
    if branch is not None:
        ns.error["branch"] = branch
    ns.error["cause"] = error
    _fail_node(t, node_id, f"{subject} {why}: {message}")


def _fail_node(t: TickContext, node_id: str, reason: str) -> None:
    ns = t.nodes[node_id]
    close_branches(t, node_id, "scatter failed", revoke=True)
    if ns.error is None:
        ns.error = {"type": "ScatterFailed", "message": reason}
    ns.finished_at = t.now
    t.move_node(node_id, NodeStatus.FAILED, reason)


def close_branches(t: TickContext, node_id: str, reason: str, *, revoke: bool) -> None:
    """Close every branch in flight (and drop pending retries) of a scatter node; child runs
    get the node's parent-close policy."""
    sc = t.nodes[node_id].scatter
    if sc is None:
        return
    child_runs = isinstance(t.spec.graph.nodes[node_id], ChildScatterNodeSpec)
    for branch in list(sc.branches.values()):
        if child_runs:
            children.close_child(t, node_id, branch.token or "", reason)
        else:
            close_slot(t, node_id, branch, reason, revoke=revoke)
    sc.branches.clear()
    sc.gathering = False


def close_slot(t: TickContext, node_id: str, slot: Slot, reason: str, *, revoke: bool) -> None:
    """Close the attempt a slot waits on, whatever state it is in, and clear the slot."""
    p = t.payload
    token = slot.token
    if token is not None:
        # Never send an attempt that is closed (a send queued earlier in this tick).
        p.dispatches = [d for d in p.dispatches if d.token != token or d.kind != DispatchKind.STEP]
        created = any(a.token == token for a in p.new_attempts)
        if created:
            # Started in this very tick: there is no row to close yet, so never insert it.
            p.new_attempts = [a for a in p.new_attempts if a.token != token]
        elif not any(r.token == token for r in t.inputs.results):
            # An attempt whose result is loaded has finished already: it is folded instead
            # (closing it would conflict on every recompute).
            spec = t.attempt_spec(node_id)
            error = {"type": "Cancelled", "message": reason}
            p.closed.append(ClosedAttempt(token, AttemptOutcome.CANCELLED, error, step=spec.step))
            if revoke:
                p.dispatches.append(
                    Dispatch(DispatchKind.REVOKE, t.inputs.run_id, node_id, token, spec.step, None)
                )
    slot.token = None
    slot.check_at = None
    slot.resend_at = None
    slot.retry_at = None
    p.changed = True


def child_final(run_id: str, status: str, output: Any, error: Any) -> tuple[bool, Any]:
    """A finished child run as a child-run scatter branch's final (ok, value): its output, or
    a ``ChildRunFailed`` error naming it (the SQL store and the fake read rows the same way)."""
    if status == RunStatus.SUCCEEDED:
        return True, output
    return False, {
        "type": "ChildRunFailed",
        "message": f"child run {run_id} {status}",
        "child_error": error,
    }


def attempt_final(outcome: str | None, output: Any, error: Any) -> tuple[bool, Any]:
    """A scatter branch's last attempt row as its final (ok, value): its output if it
    succeeded, otherwise its error (the SQL store and the fake read rows the same way)."""
    if outcome == AttemptOutcome.SUCCEEDED:
        return True, output
    return False, error


def assemble(sc: ScatterState, finals: dict[int, tuple[bool, Any]]) -> list[Any]:
    """The gathered list from each branch's final attempt, by branch index:
    ``(succeeded, output or error)``. A failed branch's place holds ``{"error": ...}``."""
    out: list[Any] = []
    for index in range(sc.total):
        if index in sc.errors:
            out.append({"error": sc.errors[index]})
            continue
        ok, value = finals.get(index, (False, {"type": "Missing", "message": "no attempt row"}))
        out.append(value if ok else {"error": value})
    return out


#: One finished attempt of a batch, as the gather reads it: (succeeded, output, error). The
#: output of an attempt the coordinator closed (timed out, cancelled) is passed as ``None``:
#: only outputs the worker wrote with its outcome were counted by the tick.
BatchAttempt = tuple[bool, Any, Any]


def batch_attempt(outcome: str | None, output: Any, error: Any) -> BatchAttempt:
    """One finished attempt row of a batch as the gather reads it (``BatchAttempt``)."""
    counted = outcome in RAN_TO_END
    return outcome == AttemptOutcome.SUCCEEDED, output if counted else None, error


def assemble_batched(sc: ScatterState, attempts: dict[int, list[BatchAttempt]]) -> list[Any]:
    """The gathered list of a batched scatter, from each batch's finished attempts (oldest
    first), flattened to one value per item in item order.

    A batch whose last attempt succeeded gives its list. Otherwise each item gets the output
    recorded for it by any attempt of the batch (``{"done": {index: output}}``), else
    ``{"error": ...}``: its own error from the last attempt, or the batch's (timed out).
    """
    out: list[Any] = []
    for branch in range(-(-sc.total // sc.batch)):
        span = sc.batch_items(branch)
        values = _batch_values(span, attempts.get(branch, []))
        out.extend(
            {"error": sc.errors[i]} if i in sc.errors else value
            for i, value in zip(span, values, strict=True)
        )
    return out


def _batch_values(span: range, attempts: list[BatchAttempt]) -> list[Any]:
    if attempts:
        ok, output, _ = attempts[-1]
        if ok and isinstance(output, list) and len(output) == len(span):
            return output
    done: dict[str, Any] = {}
    final: dict[str, Any] = {}
    for _, output, _ in attempts:
        if isinstance(output, dict):
            done.update(output.get("done") or {})
            final.update(output.get("failed") or {})
    last = attempts[-1][2] if attempts else None
    if not isinstance(last, dict):
        last = {"type": "Missing", "message": "no attempt row"}
    items = last.get("items")
    mine: dict[str, Any] = items if isinstance(items, dict) else {}
    whole = {k: v for k, v in last.items() if k != "items"}
    values: list[Any] = []
    for index in span:
        key = str(index)
        if key in done:
            values.append(done[key])
        else:
            values.append({"error": mine.get(key) or final.get(key) or whole})
    return values


def _gathered(t: TickContext, node_id: str, sc: ScatterState, gathered: list[Any]) -> None:
    ns = t.nodes[node_id]
    sc.gathering = False
    sc.deadline = None
    ns.finished_at = t.now
    t.outputs[node_id] = gathered
    t.move_node(
        node_id,
        NodeStatus.SUCCEEDED,
        f"gathered {sc.total} branches ({sc.succeeded} succeeded, {sc.failed} failed)",
    )
