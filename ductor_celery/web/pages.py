"""The console's HTML pages: the runs list, a run, logging in, and the forms' actions."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from ..call_checks import check_target
from ..definition.spec import ApprovalNodeSpec
from ..engine.kinds import CONTROL_ALLOWED
from ..engine.status import OPEN_RUN_STATUSES, TERMINAL_RUN_STATUSES, NodeStatus, RunStatus
from ..errors import RunNotFound
from ..store import console as reads
from ..store import runs
from .actions import ACTION_ROLES, ACTIONS, parse_json, run_action
from .api import query_params
from .auth import (
    READ_ONLY,
    Forbidden,
    actor,
    check_csrf,
    check_form,
    csrf_token,
    log_in,
    log_out,
    session_token,
)
from .console import Console, message_of, status_of
from .live import run_live
from .params import LIST_PARAMS, TAG_PARAM, BadRequest, list_query
from .tokens import Role

#: Attempt rows the run page shows at most (the newest; a scatter has one per branch).
ATTEMPTS_SHOWN = 50
#: Audit entries the run page shows at most (the newest).
AUDIT_SHOWN = 50
#: Controls offered as buttons, in this order, when the run's status allows them.
CONTROL_BUTTONS = ("pause", "resume", "cancel", "terminate", "redrive")


def _session(console: Console, request: Request) -> dict[str, Any]:
    """What every template shows of the session: its CSRF token, who logged in, and whether
    that token may act on runs (the forms are offered only then)."""
    who = session_token(request, console)
    return {
        "csrf": csrf_token(request),
        "logged_in": who is not None,
        "who": who,
        "can_act": who is not None and who.role.allows(Role.OPERATOR),
    }


def _page(console: Console, request: Request, name: str, status: int = 200, **ctx: Any) -> Response:
    html = console.render(
        name,
        request=request,
        flash=request.session.pop("flash", None),
        **_session(console, request),
        **ctx,
    )
    return HTMLResponse(html, status_code=status)


def login_page(console: Console) -> Callable[[Request, int, str], Response]:
    """The login page as ``auth.ReadGate`` answers a page that needs a token: with its status
    and why, and a way back to the page asked for."""

    def answer(request: Request, status: int, problem: str) -> Response:
        nxt = _safe_next_value(
            request.url.path + (f"?{request.url.query}" if request.url.query else "")
        )
        return _page(console, request, "login.html", status, next=nxt, problem=problem)

    return answer


def _error_page(console: Console, request: Request, exc: BaseException) -> Response:
    code = status_of(exc)
    return _page(console, request, "error.html", code, code=code, message=message_of(exc))


# -- the runs list ------------------------------------------------------------------------------


def runs_context(console: Console, request: Request) -> tuple[int, dict[str, Any]]:
    params = query_params(request)
    raw = {k: (params.get(k) or [""])[-1] for k in LIST_PARAMS}
    # The tag filter repeats (tag=k:v&tag=k2:v2): kept as pairs in every link the page makes.
    tag_pairs = [(TAG_PARAM, v) for v in params.get(TAG_PARAM) or [] if v]
    ctx: dict[str, Any] = {
        "query": raw,
        "tag_filters": [v for _, v in tag_pairs],
        "statuses": [s.value for s in RunStatus],
        "runs": [],
        "counts": {},
        "next_url": None,
        "error": None,
        "first_page": True,
        "first_url": "/",
        "status_url": None,
    }
    try:
        kwargs = list_query(params, datetime.now(UTC), strict=False)
        # A list never reads large values: a placeholder, and no dangling reference breaks it.
        page = console.ductor.list_runs(**kwargs, large_values=False)
        where = runs.RunFilter(
            workflow=kwargs["workflow"],
            workflow_id=kwargs["workflow_id"],
            since=kwargs["since"],
            until=kwargs["until"],
            tags=tuple(kwargs["tags"].items()),
        )
        ctx["counts"] = runs.count_by_status(console.engine, where)
        ctx["workflows"] = reads.workflow_names(console.engine)
    except (BadRequest, ValueError, TypeError) as exc:
        ctx["error"] = message_of(exc)
        ctx["workflows"] = []
        return 400, ctx
    ctx["runs"] = list(page)
    kept = [(k, v) for k, v in raw.items() if v and k != "cursor"] + tag_pairs
    if page.next_cursor is not None:
        ctx["next_url"] = "/?" + urlencode([*kept, ("cursor", page.next_cursor)])
    ctx["first_page"] = not raw["cursor"]
    ctx["first_url"] = "/?" + urlencode(kept) if kept else "/"
    ctx["status_url"] = lambda status: (
        "/?" + urlencode([*((k, v) for k, v in kept if k != "status"), ("status", status)])
    )
    return 200, ctx


# -- a run ------------------------------------------------------------------------------------


def _forms(console: Console, view: Any, spec: Any) -> dict[str, Any]:
    """Which actions the page offers: the controls the run's status allows, a decision form
    per waiting approval, a signal form while the run is open."""
    allowed = {str(k) for k in CONTROL_ALLOWED[view.status]}
    approvals = [
        node_id
        for node_id, node in spec.graph.nodes.items()
        if isinstance(node, ApprovalNodeSpec)
        and view.nodes.get(node_id) is not None
        and view.nodes[node_id].status == NodeStatus.WAITING
    ]
    from_node = "from_node" in inspect.signature(console.ductor.redrive).parameters
    return {
        "controls": [c for c in CONTROL_BUTTONS if c in allowed],
        "approvals": approvals,
        "can_signal": view.status in OPEN_RUN_STATUSES,
        "redrive_from_node": from_node,
    }


def run_context(console: Console, run_id: str, node: str | None) -> dict[str, Any]:
    """Everything the run page and its panels show. Raises RunNotFound for an unknown id."""
    d, engine = console.ductor, console.engine
    check_target(run_id)
    view = d.get(run_id)
    if view.run_id != run_id:  # a workflow id: the page of its newest run has its own URL
        raise _Moved(view.run_id)
    row = runs.find_run(engine, run_id)
    if row is None:
        raise RunNotFound(f"no run {run_id!r}")
    spec = d.client.definition_of(run_id)
    if node is not None and node not in spec.graph.nodes:
        node = None
    attempts, attempt_count = reads.recent_attempts(engine, run_id, node, ATTEMPTS_SHOWN)
    signals, signal_count = reads.signals_of(engine, run_id)
    children, child_count = reads.children_of(engine, run_id)
    return {
        "view": view,
        "spec": spec,
        "live": run_live(row, spec.graph.order),
        "layout": console.layout_of(spec),
        "selected": node,
        "attempts": attempts,
        "attempt_count": attempt_count,
        "transitions": runs.transitions_of(engine, run_id, 200),
        "signals": signals,
        "signal_count": signal_count,
        "controls": reads.controls_of(engine, run_id),
        "audit": d.audit(run_id, limit=AUDIT_SHOWN).entries,
        "children": children,
        "child_count": child_count,
        "terminal": view.status in TERMINAL_RUN_STATUSES,
        "forms": _forms(console, view, spec),
    }


class _Moved(Exception):
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id


def _node_param(request: Request) -> str | None:
    node = request.query_params.get("node") or None
    return node if node is None or len(node) <= 200 else None


# -- the routes -------------------------------------------------------------------------------


def routes(console: Console) -> list[Route]:
    def runs_page(request: Request) -> Response:
        status, ctx = runs_context(console, request)
        if request.headers.get("x-ductor-fragment") == "rows":
            html = console.render("_rows.html", **ctx)
            return HTMLResponse(html, status_code=status)
        return _page(console, request, "runs.html", status, **ctx)

    def run_page(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        try:
            ctx = run_context(console, run_id, _node_param(request))
        except _Moved as moved:
            return RedirectResponse(f"/runs/{quote(moved.run_id, safe='')}", status_code=303)
        except Exception as exc:  # noqa: BLE001 - status_of re-raises what is not ours
            return _error_page(console, request, exc)
        return _page(console, request, "run.html", **ctx)

    def panels(request: Request) -> Response:
        """The parts of the run page that change, for the page's own refresh."""
        try:
            ctx = run_context(console, request.path_params["run_id"], _node_param(request))
        except _Moved:
            return PlainTextResponse("", status_code=404)
        except Exception as exc:  # noqa: BLE001
            # Text, never HTML: the message names the id from the URL.
            return PlainTextResponse(message_of(exc), status_code=status_of(exc))
        html = console.render(
            "_fragment.html", request=request, **_session(console, request), **ctx
        )
        return HTMLResponse(html)

    async def act(request: Request) -> Response:
        run_id, action = request.path_params["run_id"], request.path_params["action"]
        try:
            form = await console.form(request)
            check_form(request, console, form, ACTION_ROLES.get(action, Role.OPERATOR), action)
            if action not in ACTIONS:
                raise BadRequest(f"unknown action {action!r}")
            body = _form_body(action, form)
            who = actor(request)
            await run_in_threadpool(run_action, console.ductor, run_id, action, body, who)
        except Exception as exc:  # noqa: BLE001
            code = status_of(exc)
            try:
                ctx = await run_in_threadpool(run_context, console, run_id, None)
            except Exception as inner:  # noqa: BLE001
                return _error_page(console, request, inner)
            return _page(console, request, "run.html", code, action_error=message_of(exc), **ctx)
        request.session["flash"] = _done(action, body)
        return RedirectResponse(f"/runs/{quote(run_id, safe='')}", status_code=303)

    def login_page(request: Request) -> Response:
        return _page(console, request, "login.html", next=_safe_next(request), problem=None)

    async def login(request: Request) -> Response:
        try:
            form = await console.form(request)
        except Exception as exc:  # noqa: BLE001
            return _error_page(console, request, exc)
        nxt = _safe_next_value(form.get("next"))
        if console.read_only:
            return _page(console, request, "login.html", 403, next=nxt, problem=READ_ONLY)
        try:
            check_csrf(request, form)
        except Forbidden as exc:
            return _page(console, request, "login.html", 403, next=nxt, problem=message_of(exc))
        token = console.tokens.match(form.get("token", ""))
        if token is None:
            return _page(console, request, "login.html", 403, next=nxt, problem="wrong token")
        log_in(request, console, token)
        can = "actions are enabled" if token.role.allows(Role.OPERATOR) else "reads only"
        request.session["flash"] = f"logged in as {token.name} ({token.role}): {can}"
        return RedirectResponse(nxt, status_code=303)

    async def logout(request: Request) -> Response:
        try:
            form = await console.form(request)
            check_form(request, console, form, Role.VIEWER, "logging out")
        except Exception as exc:  # noqa: BLE001
            return _error_page(console, request, exc)
        log_out(request)
        return RedirectResponse("/", status_code=303)

    return [
        Route("/", runs_page, methods=["GET"]),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/runs/{run_id}", run_page, methods=["GET"]),
        Route("/runs/{run_id}/panels", panels, methods=["GET"]),
        Route("/runs/{run_id}/actions/{action}", act, methods=["POST"]),
    ]


def _form_body(action: str, form: dict[str, str]) -> dict[str, Any]:
    """A form's fields as the action's JSON body: empty fields are absent, JSON fields parsed."""
    fields = {k: v for k, v in form.items() if k != "csrf_token" and v != ""}
    for key in ("payload", "input"):
        if key in fields:
            fields[key] = parse_json(fields[key], key)
    return fields


def _done(action: str, body: dict[str, Any]) -> str:
    if action in ("approve", "reject"):
        return f"{action}d {body.get('node')}"
    if action == "signal":
        return f"signal {body.get('name')!r} sent"
    return f"{action} requested"


def _safe_next_value(value: str | None) -> str:
    """Only a path of this console: never a redirect to another site."""
    if (
        value
        and value.startswith("/")
        and not value.startswith("//")
        and "\\" not in value
        # Browsers drop tabs and newlines from URLs: "/\t/evil.example" would be "//evil...".
        and value.isprintable()
    ):
        return value
    return "/"


def _safe_next(request: Request) -> str:
    return _safe_next_value(request.query_params.get("next"))
