"""The Celery app of the export end-to-end test (tests/e2e/test_replay_e2e.py): the
``replay_order`` workflow of ``replay_support``, configured from the environment like
``rate_app`` (DUCTOR_DATABASE_URL, E2E_BROKER_URL)."""

from __future__ import annotations

import os

from celery import Celery
from replay_support import define

from ductor_celery import Ductor

app = Celery("replay_e2e")
app.conf.update(
    broker_url=os.environ.get("E2E_BROKER_URL", "memory://"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    ductor_sweep_interval=0.2,
)
ductor = Ductor(app)
define(ductor)
