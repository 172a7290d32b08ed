"""Issue 22, item 5: a secret is redacted in every form a program commonly prints it (itself,
the inner text of its repr() and of its JSON string with and without ensure_ascii,
URL-quoted), longest form first; a secret of one to three characters only where it stands
alone."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ductor_celery.runtime import secrets
from ductor_celery.runtime.secrets import AttemptSecrets, redact_text

#: A quote, a backslash, an apostrophe, non-ASCII letters, an emoji, a space, '&', '/', '%',
#: '+', '=', '?': each is printed differently by repr, JSON and URL quoting.
SECRET = "pä\"s\\w'ß é/&%😀+=?Zq9"

#: The forms the contract names, as a program prints them.
FORMS: dict[str, Callable[[str], str]] = {
    "str": str,
    "repr": lambda s: repr(s)[1:-1],
    "ascii": lambda s: ascii(s)[1:-1],
    "json": lambda s: json.dumps(s)[1:-1],
    "json-utf8": lambda s: json.dumps(s, ensure_ascii=False)[1:-1],
    "quote": quote,
    "quote-safe-none": lambda s: quote(s, safe=""),
    "quote-plus": quote_plus,
}


def test_the_test_secret_is_printed_differently_by_every_form() -> None:
    printed = {name: form(SECRET) for name, form in FORMS.items()}
    assert len(set(printed.values())) == len(printed), printed


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_every_form_of_a_secret_is_redacted_in_text(form: Callable[[str], str]) -> None:
    text = f"before {form(SECRET)} after"
    assert redact_text(text, [SECRET]) == "before *** after"


@pytest.mark.parametrize(
    "printed",
    [
        lambda s: str(KeyError(s)),
        lambda s: repr(KeyError(s)),
        lambda s: repr({"key": s, "list": [s]}),
        lambda s: json.dumps({"key": s}),
        lambda s: json.dumps({"key": s}, ensure_ascii=False),
        lambda s: f"https://api.example.com/pay?key={quote_plus(s)}&path=/{quote(s)}",
        lambda s: f"{s!r} {s!a} {s}",
    ],
    ids=["KeyError", "repr-KeyError", "repr-dict", "json", "json-utf8", "url", "fstring"],
)
def test_what_programs_print_holds_no_form_of_the_secret(printed: Callable[[str], str]) -> None:
    out = redact_text(printed(SECRET), [SECRET])
    assert "***" in out
    for name, form in FORMS.items():
        assert form(SECRET) not in out, name


def test_an_attempts_values_are_redacted_in_every_form() -> None:
    s = AttemptSecrets(lambda name: SECRET)
    assert s.get("weird") == SECRET
    value = {
        "forms": [form(SECRET) for form in FORMS.values()],
        json.dumps(SECRET): {"nested": repr(SECRET)},
    }
    redacted = s.redact(value)
    assert redacted == {"forms": ["***"] * len(FORMS), '"***"': {"nested": "'***'"}}


def test_overlapping_forms_leave_no_fragment() -> None:
    # The JSON form holds the raw text's pieces: replacing the raw text first would leave
    # backslashes, and the longest form goes first.
    secret = 'ab"cd"ef'
    text = f"{json.dumps(secret)} {secret} {repr(secret)}"
    assert redact_text(text, [secret]) == "\"***\" *** '***'"
    # A secret inside another secret: the longer one is replaced whole.
    assert redact_text("tok-1234-more and tok-1234", ["tok-1234", "tok-1234-more"]) == (
        "*** and ***"
    )


def test_a_cut_does_not_leave_a_fragment_of_a_long_error_message() -> None:
    from ductor_celery.runtime.step_errors import MESSAGE_CHARS as _MESSAGE_CHARS
    from ductor_celery.runtime.step_errors import error_of as _error_of

    s = AttemptSecrets(lambda name: SECRET)
    s.get("weird")
    # The secret straddles the message's cut: redacted before it, not after.
    exc = RuntimeError("x" * (_MESSAGE_CHARS - 5) + SECRET)
    error = s.redact(_error_of(exc, s.redact_text))
    assert error["message"] == "x" * (_MESSAGE_CHARS - 5) + "***"


@given(
    secret=st.text(min_size=4).filter(lambda s: "*" not in s),
    before=st.text(max_size=20),
    after=st.text(max_size=20),
    form=st.sampled_from(sorted(FORMS)),
)
def test_no_form_of_any_secret_survives(secret: str, before: str, after: str, form: str) -> None:
    out = redact_text(before + FORMS[form](secret) + after, [secret])
    for name, printed in FORMS.items():
        assert printed(secret) not in out, name


# -- short secrets ------------------------------------------------------------------------------


def test_a_short_secret_is_redacted_only_where_it_stands_alone() -> None:
    # Replacing "ab" inside every word would wreck the text it is found in (and every log
    # line of the worker): a secret of one to three characters is replaced where it is not
    # touching a letter, digit or '_'.
    assert redact_text("ab", ["ab"]) == "***"
    assert redact_text("key=ab; KeyError('ab')", ["ab"]) == "key=***; KeyError('***')"
    assert redact_text("abbey tab _ab ab1", ["ab"]) == "abbey tab _ab ab1"
    # Its longer forms are distinctive: replaced wherever they are.
    assert redact_text(f"x{json.dumps('é')[1:-1]}y {quote('é')}", ["é"]) == "x***y ***"
    assert redact_text("café é", ["é"]) == "café ***"


def test_a_secret_that_the_redaction_marker_holds_is_not_redacted_into_a_mess() -> None:
    s = AttemptSecrets(lambda name: "*")
    s.get("star")
    assert s.redact({"k": "a * b"}) == {"k": "a * b"}


# -- log lines ------------------------------------------------------------------------------------


def test_every_form_is_redacted_in_log_lines() -> None:
    handler = logging.StreamHandler()
    logging.getLogger().addHandler(handler)
    try:
        AttemptSecrets(lambda name: SECRET).get("weird")
        printed = [form(SECRET) for form in FORMS.values()]
        record = logging.LogRecord(
            "x", logging.INFO, __file__, 1, "using %s", (" | ".join(printed),), None
        )
        try:
            raise KeyError(SECRET)
        except KeyError:
            failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "%s", ("x",), None)
            failed.exc_info = sys.exc_info()
        for f in handler.filters:
            assert isinstance(f, secrets.RedactingFilter)
            f.filter(record)
            f.filter(failed)
        message = record.getMessage()
        assert message == "using " + " | ".join(["***"] * len(FORMS))
        assert "KeyError: '***'" in (failed.exc_text or "")
        for form in printed:
            assert form not in (failed.exc_text or "")
    finally:
        logging.getLogger().removeHandler(handler)
