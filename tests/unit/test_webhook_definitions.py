"""``ductor.webhook(...)``'s checks at registration (DefinitionError naming the problem, never
a secret's value) and the signature schemes (definition/webhooks.py), without a database."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import pytest
from celery import Celery

from ductor_celery import DefinitionError, Ductor
from ductor_celery.definition.webhooks import (
    REPLAY_WINDOW_S,
    BadSignature,
    Scheme,
    Webhook,
    sign,
    verify,
)

SECRET_REF = "$.secret.hook_key"


@pytest.fixture
def d(tmp_path: Any) -> Ductor:
    app = Celery("hookdefs", broker="memory://", set_as_current=False)
    return Ductor(app, database_url=f"sqlite:///{tmp_path}/unused.sqlite3")


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        (("",), {"workflow": "w"}, "webhook name must not be empty"),
        (("x" * 201,), {"workflow": "w"}, "webhook name must be at most 200 characters"),
        (("a\x00b",), {"workflow": "w"}, "webhook name must not contain NUL"),
        ((7,), {"workflow": "w"}, "webhook name must be a string"),
        (("h",), {}, "takes exactly one of workflow= (start a run) and signal="),
        (("h",), {"workflow": "w", "signal": "s"}, "takes exactly one of workflow="),
        (("h",), {"signal": "paid"}, "a signal hook needs target="),
        (("h",), {"signal": "ductor.x", "target": "$.body.o"}, "names starting 'ductor.'"),
        (
            ("h",),
            {"signal": "s", "target": "$.body.o", "workflow_id": "$.body.id"},
            "is for a start hook",
        ),
        (("h",), {"workflow": "w", "target": "$.body.o"}, "target= is for a signal hook"),
        (
            ("h",),
            {"workflow": "w", "workflow_id": "$.input.id"},
            "must be a path into the request body",
        ),
        (("h",), {"workflow": "w", "workflow_id": "$.body"}, "names the whole body"),
        (("h",), {"workflow": "w", "workflow_id": "$.body.a b"}, "malformed path '$.body.a b'"),
        (("h",), {"workflow": "w", "workflow_id": 5}, "must be a path into the request body"),
        (("h",), {"signal": "s", "target": "order"}, "must be a path into the request body"),
        (("h",), {"workflow": ""}, "workflow must not be empty"),
        (("h",), {"workflow": "w", "scheme": "gitlab"}, "unknown scheme 'gitlab'"),
        (("h",), {"workflow": "w", "secret": "$.secret.9bad"}, "secret name '9bad' is not valid"),
        (("h",), {"workflow": "w", "secret": "$.secret.ß"}, "is not valid"),
        (("h",), {"workflow": "w", "secret": None}, "secret= must be a reference"),
    ],
)
def test_a_bad_webhook_is_refused_at_registration_naming_the_problem(
    d: Ductor, args: tuple[Any, ...], kwargs: dict[str, Any], needle: str
) -> None:
    kwargs = {"secret": SECRET_REF, **kwargs}
    with pytest.raises(DefinitionError) as raised:
        d.webhook(*args, **kwargs)
    assert needle in str(raised.value)
    assert list(d.webhooks) == []


def test_a_literal_secret_is_refused_without_showing_it(d: Ductor) -> None:
    with pytest.raises(DefinitionError) as raised:
        d.webhook("h", workflow="w", secret="whsec_live_Zq9")
    assert "whsec_live_Zq9" not in str(raised.value)
    assert "not the secret itself" in str(raised.value)


def test_names_are_unique_and_the_same_hook_again_is_a_no_op(d: Ductor) -> None:
    first = d.webhook("h", workflow="w", secret=SECRET_REF, workflow_id="$.body.id")
    again = d.webhook("h", workflow="w", secret=SECRET_REF, workflow_id="$.body.id")
    assert first == again and first.secret == "hook_key" and first.scheme == Scheme.DUCTOR
    with pytest.raises(DefinitionError, match="a different webhook named 'h' is registered"):
        d.webhook("h", workflow="other", secret=SECRET_REF)
    d.webhook("s", signal="paid", target="$.body.orders[0].id", secret=SECRET_REF)
    assert [h.name for h in d.webhooks] == ["h", "s"]


HOOK = Webhook(name="h", secret="k", scheme=Scheme.DUCTOR, workflow="w")
NOW = 1_800_000_000.0


def _mac(secret: str, message: bytes) -> str:
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def test_the_ductor_signature_is_an_hmac_of_time_dot_body_within_the_window() -> None:
    body = b'{"id": "evt_1"}'
    key = "s3cr\u00e9t"
    header = sign(key, body, NOW)
    assert header == f"t={int(NOW)},v1={_mac(key, b'1800000000.' + body)}"
    for skew in (-REPLAY_WINDOW_S, 0, REPLAY_WINDOW_S):
        verify(HOOK, {"x-ductor-signature": header}, body, lambda: key, NOW + skew)
    for skew in (-REPLAY_WINDOW_S - 1, REPLAY_WINDOW_S + 1):
        with pytest.raises(BadSignature, match="accepted within 300 s"):
            verify(HOOK, {"X-Ductor-Signature": header}, body, lambda: key, NOW + skew)
    with pytest.raises(BadSignature, match="does not match"):
        verify(HOOK, {"X-Ductor-Signature": header}, body + b" ", lambda: key, NOW)
    with pytest.raises(BadSignature, match="does not match"):
        verify(HOOK, {"X-Ductor-Signature": header}, body, lambda: "other", NOW)


def test_the_secret_is_asked_for_only_once_the_header_is_usable() -> None:
    asked: list[str] = []

    def secret() -> str:
        asked.append("yes")
        return "k"

    for headers in ({}, {"X-Ductor-Signature": "garbage"}, {"X-Ductor-Signature": "t=1,v1=00"}):
        with pytest.raises(BadSignature):
            verify(HOOK, headers, b"{}", secret, NOW)
    assert asked == []


def test_github_signs_the_body_alone_under_its_header() -> None:
    hook = Webhook(name="gh", secret="k", scheme=Scheme.GITHUB, workflow="w")
    body = b'{"ref": "main"}'
    header = sign("k", body, NOW, "github")
    assert header == "sha256=" + _mac("k", body)
    verify(
        hook,
        {"X-Hub-Signature-256": header.upper().replace("SHA256", "sha256")},
        body,
        lambda: "k",
        0,
    )
    with pytest.raises(BadSignature, match="X-Hub-Signature-256 header is missing"):
        verify(hook, {"X-Ductor-Signature": sign("k", body, NOW)}, body, lambda: "k", NOW)
