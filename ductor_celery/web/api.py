"""The JSON API beside the pages: runs, one run, the actions and starts (bearer token),
``/metrics``."""

from __future__ import annotations

from datetime import UTC, datetime

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..call_checks import check_target
from ..store import runs
from .actions import ACTION_ROLES, ACTIONS, json_body, run_action
from .auth import CHALLENGE, actor, check_bearer
from .console import Console, message_of, status_of
from .live import run_live
from .metrics import exposition, registry_for
from .params import BadRequest, list_query
from .starts import IDEMPOTENCY_HEADER, idempotency_key, start_run
from .tokens import Role


def error(exc: BaseException) -> JSONResponse:
    code = status_of(exc)
    headers = CHALLENGE if code == 401 else None
    return JSONResponse({"error": message_of(exc)}, status_code=code, headers=headers)


def query_params(request: Request) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for key, value in request.query_params.multi_items():
        found.setdefault(key, []).append(value)
    return found


def routes(console: Console) -> list[Route]:
    d = console.ductor
    registry = registry_for(lambda: console.engine)

    def list_runs(request: Request) -> Response:
        try:
            kwargs = list_query(query_params(request), datetime.now(UTC), strict=True)
            # A list never reads large values (docs/large-values.md): "large value (N bytes)".
            page = d.list_runs(**kwargs, large_values=False)
        except Exception as exc:  # noqa: BLE001 - status_of re-raises what is not ours
            return error(exc)
        return JSONResponse(
            {"runs": [v.model_dump(mode="json") for v in page], "next_cursor": page.next_cursor}
        )

    def get_run(request: Request) -> Response:
        try:
            view = d.get(request.path_params["run_id"])
        except Exception as exc:  # noqa: BLE001
            return error(exc)
        return JSONResponse(view.model_dump(mode="json"))

    def live(request: Request) -> Response:
        """The run page's poll: one read of the run row."""
        try:
            run_id = check_target(request.path_params["run_id"])
            row = runs.find_run(console.engine, run_id)
            if row is None or row.run_id != run_id:
                return JSONResponse({"error": f"no run {run_id!r}"}, status_code=404)
            spec = d.client.definition_of(run_id)
        except Exception as exc:  # noqa: BLE001
            return error(exc)
        return JSONResponse(run_live(row, spec.graph.order))

    async def act(request: Request) -> Response:
        run_id, action = request.path_params["run_id"], request.path_params["action"]
        try:
            # First: a read-only console refuses all, and nobody learns more without a token.
            check_bearer(request, console, ACTION_ROLES.get(action, Role.OPERATOR), action)
            if action not in ACTIONS:
                raise BadRequest(f"unknown action {action!r} (one of: {', '.join(ACTIONS)})")
            body = json_body(await console.body(request))
            await run_in_threadpool(run_action, d, run_id, action, body, actor(request))
            view = await run_in_threadpool(d.get, run_id)
        except Exception as exc:  # noqa: BLE001
            return error(exc)
        return JSONResponse(view.model_dump(mode="json"))

    async def start(request: Request) -> Response:
        """Start a run of the workflow (docs/console.md, "Starting runs over HTTP")."""
        try:
            check_bearer(request, console, Role.OPERATOR, "start")
            key = idempotency_key(request.headers.get(IDEMPOTENCY_HEADER))
            body = json_body(await console.body(request))
            workflow = request.path_params["name"]
            handle, created = await run_in_threadpool(
                start_run, d, workflow, body, key, actor(request)
            )
        except Exception as exc:  # noqa: BLE001
            return error(exc)
        return JSONResponse(
            {"run_id": handle.run_id, "workflow_id": handle.workflow_id},
            status_code=201 if created else 200,
        )

    def metrics(request: Request) -> Response:
        return Response(exposition(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return [
        Route("/api/runs", list_runs, methods=["GET"]),
        Route("/api/runs/{run_id}", get_run, methods=["GET"]),
        Route("/api/runs/{run_id}/{action}", act, methods=["POST"]),
        Route("/api/workflows/{name:path}/runs", start, methods=["POST"]),
        Route("/runs/{run_id}/live", live, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
