"""Issue 15, item 2: secrets by reference: where they may appear in a definition, what the tick
leaves of them, how the worker fills and redacts them."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from support import FakeStep

from ductor_celery import DefinitionError, SecretNotFound, Workflow
from ductor_celery.definition.paths import Scope, resolve, secret_slots
from ductor_celery.runtime import secrets
from ductor_celery.runtime.secrets import AttemptSecrets, SecretUnavailable, load_provider
from ductor_celery.settings import Settings

STEP = FakeStep("s.pay")


def test_a_secret_reference_is_accepted_in_a_steps_args_and_left_unresolved() -> None:
    wf = Workflow("pay")
    wf.step("pay", STEP, args={"api_key": "$.secret.stripe", "cfg": {"k": ["$.secret.b"]}})
    wf.build()
    scope = Scope(input={"x": 1}, context={}, outputs={})
    # The tick stores the reference itself: only the worker resolves it.
    assert resolve({"api_key": "$.secret.stripe"}, scope) == {"api_key": "$.secret.stripe"}


@pytest.mark.parametrize(
    "build",
    [
        lambda wf: wf.step("s", STEP, when="$.secret.x"),
        lambda wf: wf.scatter("s", STEP, over="$.secret.x", item_arg="item"),
        lambda wf: wf.subworkflow("s", workflow="other", input={"k": "$.secret.x"}),
        lambda wf: (wf.step("s", STEP), wf.output({"k": "$.secret.x"})),
    ],
    ids=["when", "over", "child-input", "output"],
)
def test_a_secret_reference_anywhere_but_args_is_refused(build: Any) -> None:
    wf = Workflow("pay")
    build(wf)
    with pytest.raises(DefinitionError, match=r"\$\.secret\.x"):
        wf.build()


@pytest.mark.parametrize("bad", ["$.secret", "$.secret.a.b", "$.secret[0]"])
def test_a_malformed_secret_reference_is_refused(bad: str) -> None:
    wf = Workflow("pay")
    wf.step("s", STEP, args={"k": bad})
    with pytest.raises(DefinitionError, match="malformed path"):
        wf.build()


def test_slots_name_only_the_templates_references() -> None:
    template = {"key": "$.secret.a", "nested": {"list": [1, "$.secret.b"]}, "x": "$.input.x"}
    assert secret_slots(template) == ((("key",), "a"), (("nested", "list", 1), "b"))


def _provider(values: dict[str, str]) -> AttemptSecrets:
    return AttemptSecrets(lambda name: values[name])


def test_fill_puts_values_only_at_the_slots_and_copies() -> None:
    s = _provider({"a": "AAA-secret", "b": "BBB-secret"})
    args = {"key": "$.secret.a", "data": "$.secret.b", "nested": {"list": [1, "$.secret.b"]}}
    slots = ((("key",), "a"), (("nested", "list", 1), "b"))
    filled = s.fill(args, slots)
    assert filled == {
        "key": "AAA-secret",
        "data": "$.secret.b",  # not a slot: data that looks like a reference stays data
        "nested": {"list": [1, "BBB-secret"]},
    }
    assert args["nested"] == {"list": [1, "$.secret.b"]}  # the claimed arguments untouched


def test_redaction_covers_text_keys_and_nested_values() -> None:
    s = _provider({"a": "AAA-secret", "long": "AAA-secret-and-more"})
    s.get("a")
    s.get("long")
    value = {"msg": "key AAA-secret-and-more / AAA-secret", "AAA-secret": [1, "xAAA-secretx"]}
    assert s.redact(value) == {"msg": "key *** / ***", "***": [1, "x***x"]}


def test_a_missing_secret_names_it_and_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUCTOR_SECRET_NOPE", raising=False)
    s = AttemptSecrets(None)
    with pytest.raises(SecretNotFound, match="secret 'nope' .* DUCTOR_SECRET_NOPE is not set"):
        s.get("nope")
    assert issubclass(SecretNotFound, Exception) and not s.used
    lookup = _provider({})
    with pytest.raises(SecretNotFound, match="'other'"):
        lookup.get("other")


def test_the_default_provider_reads_the_upper_cased_env_var(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DUCTOR_SECRET_STRIPE", "sk_test_1")
    assert AttemptSecrets().get("stripe") == "sk_test_1"


def vault(name: str) -> str:
    if name == "down":
        raise ConnectionError("vault unreachable")
    return f"value-of-{name}"


def test_a_provider_by_dotted_path(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings.from_conf({"ductor_secret_provider": f"{__name__}:vault"})
    s = AttemptSecrets(settings.secret_provider)
    assert s.get("x") == "value-of-x"
    with pytest.raises(SecretUnavailable, match="'down': the provider raised ConnectionError"):
        s.get("down")
    assert load_provider(f"{__name__}.vault") is vault
    with pytest.raises(ValueError, match="dotted path"):
        load_provider("novault")
    with pytest.raises(SecretUnavailable, match="'x': ductor_secret_provider 'no.such:thing'"):
        AttemptSecrets("no.such:thing").get("x")  # loaded only when a secret is needed
    local = {"k": "v"}
    callable_setting = Settings.from_conf({"ductor_secret_provider": local.__getitem__})
    assert AttemptSecrets(callable_setting.secret_provider).get("k") == "v"


def test_log_lines_of_the_process_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    handler = logging.StreamHandler()
    logging.getLogger().addHandler(handler)
    try:
        s = _provider({"k": "tok-Zx81-secret"})
        s.get("k")
        assert secrets.RedactingFilter() is not None
        assert any(isinstance(f, secrets.RedactingFilter) for f in handler.filters)
        record = logging.LogRecord(
            "x", logging.INFO, __file__, 1, "using %s", ("tok-Zx81-secret",), None
        )
        for f in handler.filters:
            f.filter(record)  # type: ignore[union-attr]
        assert record.getMessage() == "using ***"
        try:
            raise RuntimeError("bad tok-Zx81-secret")
        except RuntimeError:
            import sys

            record = logging.LogRecord(
                "x", logging.ERROR, __file__, 1, "oops", None, sys.exc_info()
            )
        for f in handler.filters:
            f.filter(record)  # type: ignore[union-attr]
        assert "tok-Zx81-secret" not in (record.exc_text or "") and "***" in (record.exc_text or "")
    finally:
        logging.getLogger().removeHandler(handler)
