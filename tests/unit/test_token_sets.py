"""The console's token sets (``web/tokens.py``): files and settings read strictly, every
problem one message naming the entry and never its secret, secrets kept only as digests and
compared in constant time with every entry."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest

from ductor_celery.web import tokens
from ductor_celery.web.actions import ACTION_ROLES, ACTIONS, actor_kwargs
from ductor_celery.web.tokens import Role, TokenError

SECRET = "Zq8-very-secret-value"


def _sha(secret: str) -> str:
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


def test_roles_each_allow_what_the_ones_before_allow() -> None:
    assert [r.value for r in Role] == ["viewer", "operator", "admin"]
    assert Role.ADMIN.allows(Role.OPERATOR) and Role.ADMIN.allows(Role.VIEWER)
    assert Role.OPERATOR.allows(Role.OPERATOR) and not Role.OPERATOR.allows(Role.ADMIN)
    assert not Role.VIEWER.allows(Role.OPERATOR)
    # Every run action the console offers is an operator's.
    assert set(ACTION_ROLES) == set(ACTIONS)
    assert set(ACTION_ROLES.values()) == {Role.OPERATOR}


def test_every_action_passes_the_acting_tokens_name_as_by() -> None:
    for action in ("approve", "reject", "pause", "resume", "cancel", "terminate", "redrive"):
        assert actor_kwargs(action, "alice") == {"by": "alice"}
    assert actor_kwargs("signal", "alice") == {"by": "alice"}


def test_plain_and_hashed_secrets_match_and_nothing_else_does() -> None:
    found = tokens.from_mapping(
        {
            "alice": {"secret": SECRET, "role": "operator"},
            "bob": {"secret": _sha("bob's token"), "role": "viewer"},
            "carol": {
                "secret": _sha("carol's").upper().replace("SHA256:", "sha256:"),
                "role": "admin",
            },
        },
        "test",
    )
    alice, bob, carol = found.match(SECRET), found.match("bob's token"), found.match("carol's")
    assert alice is not None and (alice.name, alice.role, alice.hashed) == (
        "alice",
        "operator",
        False,
    )
    assert bob is not None and (bob.name, bob.role, bob.hashed) == ("bob", "viewer", True)
    assert carol is not None and carol.role == Role.ADMIN
    for near in ("", SECRET[:-1], SECRET + "x", SECRET.upper(), _sha("bob's token")):
        assert found.match(near) is None
    assert found.named("bob") is bob and found.named("nobody") is None
    assert found.describe() == "alice (operator), bob (viewer), carol (admin)"


def test_every_entry_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    found = tokens.from_mapping(
        {f"t{i}": {"secret": f"secret-{i}", "role": "viewer"} for i in range(5)}, "test"
    )
    calls = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    assert found.match("secret-0") is not None  # the first one: no early exit all the same
    assert len(calls) == 5
    calls.clear()
    assert found.match("none of them") is None and len(calls) == 5


def test_the_single_token_is_one_admin_named_token() -> None:
    [token] = tokens.single("shared-T")
    assert (token.name, token.role) == ("token", Role.ADMIN)
    assert tokens.single("shared-T").match("shared-T") == token
    for bad in ("", "   ", " padded", "new\nline", 5):
        with pytest.raises(TokenError, match="the console's token must be"):
            tokens.single(bad)


def test_no_secret_or_digest_in_a_repr() -> None:
    found = tokens.from_mapping({"alice": {"secret": SECRET, "role": "admin"}}, "test")
    text = repr(found) + repr(list(found))
    assert SECRET not in text and hashlib.sha256(SECRET.encode()).hexdigest() not in text
    assert "digest" not in text and "alice" in text


@pytest.mark.parametrize(
    ("entries", "needle"),
    [
        ({}, "test has no tokens"),
        ([], "must be a mapping of token names"),
        ({"alice": SECRET}, "token 'alice' must be a mapping with 'secret' and 'role'"),
        ({"alice": {"secret": SECRET}}, "token 'alice' has no 'role'"),
        ({"alice": {"role": "viewer"}}, "token 'alice' has no 'secret'"),
        (
            {"alice": {"secret": SECRET, "role": "viewer", "secrte": SECRET}},
            "has an unknown key 'secrte'",
        ),
        ({"alice": {"secret": SECRET, "role": "root"}}, "the role must be one of"),
        ({"alice": {"secret": SECRET, "role": "Viewer"}}, "the role must be one of"),
        ({"alice": {"secret": "", "role": "viewer"}}, "token 'alice': the secret is empty"),
        ({"alice": {"secret": "  ", "role": "viewer"}}, "the secret is empty"),
        ({"alice": {"secret": 123, "role": "viewer"}}, "the secret must be a string, got int"),
        ({"alice": {"secret": f" {SECRET}", "role": "viewer"}}, "white space"),
        ({"alice": {"secret": f"{SECRET}\n", "role": "viewer"}}, "white space"),
        ({"alice": {"secret": f"{SECRET}\x00", "role": "viewer"}}, "a control character"),
        ({"alice": {"secret": "sha256:" + "a" * 63, "role": "viewer"}}, "64 hex digits"),
        ({"alice": {"secret": "sha256:" + "g" * 64, "role": "viewer"}}, "64 hex digits"),
        ({"alice": {"secret": "sha256:" + SECRET, "role": "viewer"}}, "64 hex digits"),
        ({"alice": {"secret": "sha256:", "role": "viewer"}}, "64 hex digits"),
        ({"": {"secret": SECRET, "role": "viewer"}}, "a token name must be a non-empty"),
        ({" al": {"secret": SECRET, "role": "viewer"}}, "1 to 100 printable characters"),
        ({"a" * 101: {"secret": SECRET, "role": "viewer"}}, "1 to 100 printable characters"),
        (
            {
                "alice": {"secret": SECRET, "role": "viewer"},
                "bob": {"secret": SECRET, "role": "admin"},
            },
            "the tokens 'alice' and 'bob' have one secret",
        ),
        (
            {
                "alice": {"secret": SECRET, "role": "viewer"},
                "bob": {"secret": _sha(SECRET), "role": "admin"},
            },
            "the tokens 'alice' and 'bob' have one secret",
        ),
    ],
)
def test_a_bad_mapping_is_one_message_without_the_secret(entries: Any, needle: str) -> None:
    with pytest.raises(TokenError) as caught:
        tokens.from_mapping(entries, "test")
    message = str(caught.value)
    assert needle in message and "\n" not in message
    assert SECRET not in message and hashlib.sha256(SECRET.encode()).hexdigest() not in message


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("t.json", '{"tokens": {"alice": {"secret": "x"', "is not valid JSON: Expecting"),
        (
            "t.json",
            '{"tokens": {"a": {"secret": "s1", "role": "viewer"}}, "a": 1}',
            "unknown key 'a'",
        ),
        ("t.json", "[]", "must hold a 'tokens' table"),
        (
            "t.json",
            '{"tokens": {"alice": {"secret": "' + SECRET + '", "role": "viewer"}, '
            '"alice": {"secret": "other", "role": "admin"}}}',
            "the key 'alice' appears twice",
        ),
        ("t.toml", f'[tokens.alice]\nsecret = "{SECRET}\nrole = "viewer"\n', "is not valid TOML"),
        ("t.toml", "[tokens]\n", "has no tokens"),
        ("t.toml", f'tokens = "{SECRET}"\n', "must be a mapping of token names"),
        ("t.conf", f'[token.alice]\nsecret = "{SECRET}"\nrole = "viewer"\n', "'tokens' table"),
        ("t.toml", f'[tokens.alice]\nsecret = "{SECRET}"\nrole = "sudo"\n', "role must be one"),
    ],
)
def test_a_bad_file_is_one_message_without_the_secret(
    tmp_path: Path, name: str, content: str, needle: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TokenError) as caught:
        tokens.from_file(path)
    message = str(caught.value)
    assert needle in message and "\n" not in message, message
    assert message.startswith(f"token file {path}") or message.startswith("cannot read")
    assert SECRET not in message


def test_files_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match="cannot read token file .*: No such file"):
        tokens.from_file(tmp_path / "nope.toml")
    with pytest.raises(TokenError, match="cannot read token file .*: Is a directory"):
        tokens.from_file(tmp_path)
    binary = tmp_path / "t.toml"
    binary.write_bytes(b'[tokens.a]\nsecret = "\xff\xfe"\n')
    with pytest.raises(TokenError, match=r"is not UTF-8 text \(at byte 21\)$"):
        tokens.from_file(binary)


def test_json_and_toml_files_of_the_contracts_shape(tmp_path: Path) -> None:
    as_json = tmp_path / "tokens.JSON"
    as_json.write_text(
        json.dumps({"tokens": {"alice": {"secret": _sha(SECRET), "role": "operator"}}})
    )
    as_toml = tmp_path / "tokens"
    as_toml.write_text(f'[tokens.alice]\nsecret = "{_sha(SECRET)}"\nrole = "operator"\n')
    for path in (as_json, as_toml):
        found = tokens.from_file(path).match(SECRET)
        assert found is not None and (found.name, found.role, found.hashed) == (
            "alice",
            Role.OPERATOR,
            True,
        )
