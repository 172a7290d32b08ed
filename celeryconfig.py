"""A production-style Celery configuration for ductor: Redis broker, PostgreSQL, ductor_* settings.

    app = Celery("shop")
    app.config_from_object("celeryconfig")  # this module, importable from where workers start
    ductor = Ductor(app)

Every value comes from the environment, with loopback defaults, so one file serves a laptop,
the tests (``examples/shop``, ``tests/e2e/test_examples_shop.py``) and a deployment:

* ``CELERY_BROKER_URL``: the broker (``redis://127.0.0.1:6379/0``). Celery itself lets this
  variable win over any configuration; reading it here keeps the two in step. RabbitMQ
  (``amqp://user:password@host:5672/vhost``) needs nothing else: ductor's queues are quorum
  queues there, ``DUCTOR_CLASSIC_QUEUES=true`` for classic ones (README, "With RabbitMQ");
  ``broker_transport_options`` below is Redis's and RabbitMQ ignores it.
* ``DUCTOR_DATABASE_URL``: where runs live (``postgresql+psycopg://ductor@127.0.0.1:5432/ductor``).
* ``DUCTOR_DEFAULT_STEP_TIMEOUT``: seconds (``120``).
* ``DUCTOR_<SETTING>`` for any other ``ductor_<setting>`` (README, "Settings"): unset, ductor's
  own default.

``ductor migrate`` needs no configuration file: give it ``--database-url`` or
``DUCTOR_DATABASE_URL`` (or ``-A`` an app configured from this module).
"""

import os

# --- Celery ---------------------------------------------------------------------------------
broker_url = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
broker_connection_retry_on_startup = True
# Long steps must not be redelivered by Redis mid-run: ductor finds lost workers itself, by
# step timeouts, so this only bounds how long a dead worker's message lingers unacknowledged.
broker_transport_options = {"visibility_timeout": 3600}
# Steps are late-acked: prefetch one message at a time so a long step does not hold others.
worker_prefetch_multiplier = 1
# JSON, never pickle (Celery's default, said out loud: ductor's own tasks insist on it too).
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]

# --- ductor (README, "Settings"); a None leaves ductor's own default ------------------------
ductor_database_url = os.environ.get(
    "DUCTOR_DATABASE_URL", "postgresql+psycopg://ductor@127.0.0.1:5432/ductor"
)
# A step that sets no timeout of its own is presumed lost after two minutes.
ductor_default_step_timeout = os.environ.get("DUCTOR_DEFAULT_STEP_TIMEOUT", "120")
# Behind PgBouncer in transaction pooling mode (README, "Behind PgBouncer"): a direct URL for
# wait()'s LISTEN, and DUCTOR_DATABASE_PREPARE=false.
ductor_listen_database_url = os.environ.get("DUCTOR_LISTEN_DATABASE_URL")
ductor_database_prepare = os.environ.get("DUCTOR_DATABASE_PREPARE")
ductor_steps_queue = os.environ.get("DUCTOR_STEPS_QUEUE")
ductor_coord_queue = os.environ.get("DUCTOR_COORD_QUEUE")
ductor_sweep_interval = os.environ.get("DUCTOR_SWEEP_INTERVAL")
ductor_resend_unclaimed_after = os.environ.get("DUCTOR_RESEND_UNCLAIMED_AFTER")
ductor_max_payload_bytes = os.environ.get("DUCTOR_MAX_PAYLOAD_BYTES")
ductor_eager_ticks = os.environ.get("DUCTOR_EAGER_TICKS")
ductor_inline_steps = os.environ.get("DUCTOR_INLINE_STEPS")
ductor_metrics_port = os.environ.get("DUCTOR_METRICS_PORT")
ductor_metrics_host = os.environ.get("DUCTOR_METRICS_HOST")
# On RabbitMQ: classic queues (with x-max-priority) instead of quorum queues.
ductor_classic_queues = os.environ.get("DUCTOR_CLASSIC_QUEUES")
