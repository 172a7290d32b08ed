"""Database URLs naming several hosts (issue 24, "A fleet, not a box"): the libpq form users
write, ``postgresql://u@h1:5432,h2:5433/db``, which SQLAlchemy cannot parse, becomes one it
passes through to psycopg; ``target_session_attrs=read-write`` is added when several hosts
are named; bad host lists are refused with the setting's name."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from ductor_celery.settings import Settings, normalize_url, redact_url
from ductor_celery.store.db import CONNECT_DEFAULTS, connect_defaults, psycopg_connect_args


def _psycopg(url: str) -> dict[str, object]:
    args = psycopg_connect_args(normalize_url(url))
    return {k: v for k, v in args.items() if k not in CONNECT_DEFAULTS}


def test_a_libpq_host_list_with_ports_reaches_psycopg_as_libpq_lists() -> None:
    url = normalize_url("postgresql://app:s3cret@10.0.0.1:5432,10.0.0.2:5433/ductor")
    assert sa.engine.make_url(url).drivername == "postgresql+psycopg"
    assert _psycopg(url) == {
        "dbname": "ductor",
        "user": "app",
        "password": "s3cret",
        "host": "10.0.0.1,10.0.0.2",
        "port": "5432,5433",
        "target_session_attrs": "read-write",
    }


def test_host_lists_without_ports_with_some_ports_and_with_ipv6() -> None:
    plain = _psycopg("postgres://u@db1,db2/d")
    assert plain["host"] == "db1,db2"
    assert str(plain.get("port", "")).strip(",") == ""  # libpq's default port for each
    # libpq's reading: each host its own port, an empty one is the default (5432).
    some = _psycopg("postgresql://u@db1,db2:6432/d")
    assert (some["host"], some["port"]) == ("db1,db2", ",6432")
    v6 = _psycopg("postgresql+psycopg://u@[::1]:5432,[fe80::1],db3:7/d")
    assert (v6["host"], v6["port"]) == ("::1,fe80::1,db3", "5432,,7")


def test_the_url_s_own_parameters_are_kept_and_a_chosen_session_attr_too() -> None:
    args = _psycopg("postgresql://u@h1,h2/d?sslmode=require&application_name=w1")
    assert (args["sslmode"], args["application_name"]) == ("require", "w1")
    assert args["target_session_attrs"] == "read-write"
    assert _psycopg("postgresql://u@h1,h2/d?target_session_attrs=primary")[
        "target_session_attrs"
    ] == ("primary")


def test_sqlalchemy_s_own_multi_host_forms_get_read_write_too() -> None:
    for url in (
        "postgresql+psycopg://u@/d?host=h1:5432&host=h2:5433",
        "postgresql+psycopg://u@/d?host=h1,h2&port=5432,5433",
    ):
        args = _psycopg(url)
        assert (args["host"], args["port"], args["target_session_attrs"]) == (
            "h1,h2",
            "5432,5433",
            "read-write",
        )


def test_one_host_is_left_as_it_was() -> None:
    for url in (
        "postgresql+psycopg://u:p@db:5432/d",
        "postgresql+psycopg://u@/d?host=/var/run/postgresql",
        "sqlite:///.ductor/x.sqlite3",
    ):
        assert normalize_url(url) == url
    assert normalize_url("postgres://u@db/d") == "postgresql+psycopg://u@db/d"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("postgresql://u@h1,,h2/d", "host 2 of 3 in 'h1,,h2' is empty"),
        ("postgresql://u@h1,/d", "host 2 of 2 in 'h1,' is empty"),
        ("postgresql://u@h1:0,h2/d", "host 1 of 2 in 'h1:0,h2' has port '0'"),
        ("postgresql://u@h1,h2:70000/d", "has port '70000'"),
        ("postgresql://u@h1:x,h2/d", "has port 'x'"),
        ("postgresql://u@h1:,h2/d", "has port ''"),
        ("postgresql://u@[::1,h2/d", "is not a bracketed IPv6 address"),
        ("postgresql://u@h1,h2/d?host=h3", "names its hosts twice"),
        ("postgresql+psycopg://u@/d?host=h1,h2&port=1,99999", "has port '99999'"),
        ("postgresql+psycopg://u@/d?host=h1,,h2", "an empty host"),
        ("postgresql://u@h1,h2/d?target_session_attrs=any", "target_session_attrs='any'"),
        ("postgresql://u@h1,h2/d?target_session_attrs=standby", "use read-write"),
    ],
)
def test_a_bad_host_list_is_refused_naming_the_setting(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match="^ductor_database_url") as info:
        normalize_url(url)
    assert problem in str(info.value)


def test_the_listen_url_s_errors_name_its_own_setting() -> None:
    conf = {
        "ductor_database_url": "postgresql://u@h1,h2/d",
        "ductor_listen_database_url": "postgresql://u@h1:5432,h2:abc/d",
    }
    with pytest.raises(ValueError, match="^ductor_listen_database_url: host 2 of 2"):
        Settings.from_conf(conf)
    settings = Settings.from_conf({**conf, "ductor_listen_database_url": None})
    assert settings.listen_url == settings.database_url


def test_a_multi_host_url_is_redacted_and_keeps_its_hosts() -> None:
    url = normalize_url("postgresql://app:s3cret@h1:5432,h2:5433/ductor")
    shown = redact_url(url)
    assert "s3cret" not in shown
    assert "***" in shown
    assert sa.engine.make_url(shown).query["host"] == "h1,h2"


def test_connections_give_up_on_a_silent_host_unless_the_url_says_otherwise() -> None:
    defaults = connect_defaults("postgresql+psycopg://u@h1/d")
    assert defaults["connect_timeout"] == "5"
    assert {"keepalives_idle", "tcp_user_timeout"} <= set(defaults)
    chosen = connect_defaults("postgresql+psycopg://u@h1/d?connect_timeout=30&keepalives=0")
    assert "connect_timeout" not in chosen and "keepalives" not in chosen
    assert psycopg_connect_args("postgresql+psycopg://u@h1/d?connect_timeout=30")[
        "connect_timeout"
    ] == ("30")
    assert connect_defaults("sqlite:///x.db") == {}
