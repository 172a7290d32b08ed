"""The web console: runs, a run's live graph, actions, a JSON API and ``/metrics``.

``ductor -A app web`` serves it; ``create_app(ductor)`` gives the Starlette app to mount in
an ASGI server of your own. See docs/console.md.

Starlette, Jinja2 and uvicorn are imported on first use, so the command line's other commands
(which import ``web.timeparse``) do not pay for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from ..ductor import Ductor


def create_app(ductor: Ductor, **options: Any) -> Starlette:
    """The console's ASGI app (options: ``token``, ``tokens``, ``token_file``, ``auth_reads``,
    ``flower_url``, ``poll_interval``, ``allowed_hosts``)."""
    from .app import create_app as make

    return make(ductor, **options)


def serve(ductor: Ductor, **options: Any) -> None:
    """Serve the console with uvicorn (options: ``host``, ``port``, and those of
    ``create_app``)."""
    from .app import serve as run

    run(ductor, **options)


__all__ = ["create_app", "serve"]
