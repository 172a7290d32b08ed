"""Issue 22, item 8: a secret's name is ASCII letters, digits and '_', not starting with a
digit, at most 100 characters: refused at register time in a definition and, from
``ctx.secret``, before the provider is asked, failing the attempt without retry."""

from __future__ import annotations

import pytest
from support import FakeStep

from ductor_celery import DefinitionError, NonRetryableError, Workflow
from ductor_celery.errors import InvalidSecretName
from ductor_celery.runtime.secrets import AttemptSecrets


@pytest.mark.parametrize(
    "name",
    ["", "ß", "\ud800", "a-b", "a.b", "1abc", "a b", "x" * 101, "K", "ﬁ"],
    ids=[
        "empty",
        "sharp-s",
        "surrogate",
        "dash",
        "dot",
        "digit-first",
        "space",
        "101",
        "ok",
        "lig",
    ],
)
def test_a_secrets_name_is_checked_before_the_provider_is_asked(name: str) -> None:
    asked: list[str] = []

    def provider(n: str) -> str:
        asked.append(n)
        return "value-never-shown"

    s = AttemptSecrets(provider)
    if name == "K":
        assert s.get(name) == "value-never-shown"
        return
    with pytest.raises(ValueError, match="secret name") as raised:
        s.get(name)
    assert isinstance(raised.value, NonRetryableError)  # the attempt fails at once
    assert asked == [] and not s.used
    assert "value-never-shown" not in str(raised.value)


def test_a_name_of_100_characters_is_accepted() -> None:
    s = AttemptSecrets(lambda n: "v")
    assert s.get("_" + "a" * 99) == "v"


@pytest.mark.parametrize(
    ("ref", "problem"),
    [
        ("$.secret.ß", "ASCII letters"),
        ("$.secret.a-b", "ASCII letters"),
        ("$.secret.1a", "not starting with a digit"),
        ("$.secret." + "x" * 101, "at most 100"),
    ],
    ids=["sharp-s", "dash", "digit-first", "101"],
)
def test_a_bad_secret_name_in_a_definition_is_refused_at_build(ref: str, problem: str) -> None:
    wf = Workflow("pay")
    wf.step("s", FakeStep("s.pay"), args={"key": ref})
    with pytest.raises(DefinitionError, match="secret") as raised:
        wf.build()
    assert problem in str(raised.value)


def test_a_bad_name_in_a_definition_stored_before_the_rule_fails_the_fill() -> None:
    # Stored definitions are parsed leniently (a run registered before the rule still ticks);
    # the worker refuses the name before it asks the provider.
    asked: list[str] = []
    s = AttemptSecrets(lambda n: asked.append(n) or "v")
    with pytest.raises(InvalidSecretName, match="secret name 'a-b' is not valid"):
        s.fill({"k": "$.secret.a-b"}, ((("k",), "a-b"),))
    assert asked == []
