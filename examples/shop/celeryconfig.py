"""A production-style Celery configuration for the shop example (Redis broker, PostgreSQL).

Environment variables override the local defaults, so the same file serves a laptop, the
tests and a deployment.
"""

import os

broker_url = os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/0")
broker_connection_retry_on_startup = True
# Steps are late-acked; keep prefetching low so a long step does not hold others hostage.
worker_prefetch_multiplier = 1
# Long steps must not be redelivered by Redis mid-run; ductor recovers lost workers itself
# through step timeouts, so this only bounds how long a dead worker's message lingers.
broker_transport_options = {"visibility_timeout": 3600}

ductor_database_url = os.environ.get(
    "DUCTOR_DATABASE_URL", "postgresql+psycopg://shop@127.0.0.1:5432/shop"
)
ductor_default_step_timeout = 120.0
ductor_sweep_interval = 1.0
