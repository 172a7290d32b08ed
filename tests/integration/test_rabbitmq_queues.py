"""How ductor declares its queues on RabbitMQ (runtime/broker.py), read from the app's queue
table as Celery's publishing side and a worker's ``-Q`` see it: no broker is needed for that
(an ``amqp://`` URL is never connected to here). The declarations on a real node, confirms
and the mismatch error with real workers: tests/e2e/test_rabbitmq_e2e.py."""

from __future__ import annotations

from typing import Any

import pytest
from amqp.exceptions import PreconditionFailed
from celery import Celery
from kombu import Queue

from ductor_celery import Ductor
from ductor_celery.errors import QueueMismatch
from ductor_celery.runtime.broker import describe_mismatch, is_amqp_url
from ductor_celery.settings import Settings

AMQP = "amqp://guest:guest@127.0.0.1:1/ductor"  # port 1: nothing here connects
QUORUM = {"x-queue-type": "quorum"}
CLASSIC = {"x-max-priority": 9}


def _ductor(broker: str = AMQP, **conf: Any) -> Ductor:
    app = Celery(f"rabbit{id(conf)}", broker=broker, set_as_current=False)
    app.conf.update(conf)
    ductor = Ductor(app, database_url="sqlite://")

    @ductor.step(name="t.side", queue="side")
    def side(ctx: Any) -> None:
        return None

    return ductor


def _arguments(ductor: Ductor, name: str) -> dict[str, Any]:
    return dict(ductor.app.amqp.queues[name].queue_arguments or {})


def test_ductors_queues_are_quorum_queues_wherever_celery_looks_them_up() -> None:
    ductor = _ductor()
    queues = ductor.app.amqp.queues
    # A worker's -Q picks them by name, before ductor has published anything.
    queues.select(["ductor-steps", "side"])
    assert dict(queues.consume_from["ductor-steps"].queue_arguments) == QUORUM
    assert dict(queues.consume_from["side"].queue_arguments) == QUORUM
    # The publishing side: send_task(queue=name) resolves the name in the same table.
    assert _arguments(ductor, "ductor-coord") == QUORUM
    assert queues["ductor-steps"].durable and not queues["ductor-steps"].auto_delete
    # The app's own queues are Celery's as before.
    assert _arguments(ductor, "reports") == {}
    assert _arguments(ductor, "celery") == {}


def test_classic_queues_get_priorities_and_quorum_ones_never_do() -> None:
    # task_queue_max_priority gives every queue x-max-priority: not ductor's quorum queues
    # (RabbitMQ 3.x refuses it there), and ductor's classic queues keep their 9.
    quorum = _ductor(task_queue_max_priority=5)
    assert _arguments(quorum, "ductor-steps") == QUORUM
    assert _arguments(quorum, "reports") == {"x-max-priority": 5}
    classic = _ductor(ductor_classic_queues=True, task_queue_max_priority=5)
    for name in ("ductor-steps", "ductor-coord", "side"):
        assert _arguments(classic, name) == CLASSIC
    assert _arguments(_ductor(ductor_classic_queues="yes"), "ductor-coord") == CLASSIC


def test_a_queue_the_app_declares_itself_keeps_its_declaration() -> None:
    mine = Queue("ductor-coord", queue_arguments={"x-queue-type": "classic"})
    ductor = _ductor(task_queues=[mine, Queue("celery")])
    ductor.runtime.queues.install()  # as before ductor's first publish
    assert _arguments(ductor, "ductor-coord") == {"x-queue-type": "classic"}
    assert _arguments(ductor, "ductor-steps") == QUORUM


def test_install_replaces_what_celery_made_of_ductors_names_before_ductor_was_there() -> None:
    app = Celery("early", broker=AMQP, set_as_current=False)
    app.amqp.queues.select(["ductor-steps"])  # a classic queue, made before Ductor(app)
    assert app.amqp.queues["ductor-steps"].queue_arguments is None
    ductor = Ductor(app, database_url="sqlite://")
    ductor.runtime.queues.install()
    assert _arguments(ductor, "ductor-steps") == QUORUM
    assert dict(app.amqp.queues.consume_from["ductor-steps"].queue_arguments) == QUORUM


@pytest.mark.parametrize("broker", ["redis://127.0.0.1:1/0", "memory://"])
def test_on_other_brokers_nothing_changes(broker: str) -> None:
    ductor = _ductor(broker)
    assert not ductor.runtime.queues.amqp
    ductor.runtime.queues.install()
    assert _arguments(ductor, "ductor-steps") == {}
    assert ductor.runtime.queues.publish_options() == {}


def test_the_setting_from_the_environment_and_its_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.from_conf({}).classic_queues is False
    monkeypatch.setenv("DUCTOR_CLASSIC_QUEUES", "true")
    assert Settings.from_conf({}).classic_queues is True
    assert Settings.from_conf({"ductor_classic_queues": False}).classic_queues is False
    monkeypatch.setenv("DUCTOR_CLASSIC_QUEUES", "quorum")
    with pytest.raises(ValueError, match=r"ductor_classic_queues \(or DUCTOR_CLASSIC_QUEUES\)"):
        Settings.from_conf({})


def test_amqp_urls() -> None:
    for url in ("amqp://h//", "amqps://h/v", "pyamqp://h", ["amqp://a", "amqp://b"], "AMQP://x"):
        assert is_amqp_url(url), url
    for url in ("redis://h/0", "memory://", "", None, "sqs://"):
        assert not is_amqp_url(url), url


def test_rabbitmqs_refusal_becomes_an_error_that_names_the_queue_and_the_way_out() -> None:
    refused = PreconditionFailed(
        reply_text="PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue "
        "'ductor-steps' in vhost 'prod': received the value 'quorum' of type 'longstr' but "
        "current is none",
        method_sig=(50, 10),
        reply_code=406,
    )
    try:
        try:
            raise refused
        except PreconditionFailed as exc:
            raise RuntimeError("publish failed") from exc  # as kombu may wrap it
    except RuntimeError as wrapped:
        found = describe_mismatch(wrapped, classic=False)
    assert isinstance(found, QueueMismatch)
    text = str(found)
    assert "RabbitMQ refused ductor's queue 'ductor-steps' (vhost 'prod')" in text
    assert "inequivalent arg 'x-queue-type'" in text
    assert "rabbitmqctl delete_queue ductor-steps -p prod" in text
    assert "ductor_classic_queues = True" in text
    classic = str(describe_mismatch(refused, classic=True))
    assert "ductor_classic_queues = False" in classic and "classic queue" in classic
    assert describe_mismatch(RuntimeError("connection reset"), classic=False) is None
