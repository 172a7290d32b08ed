"""The migrations build exactly the schema the code declares, and round-trip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from click.testing import CliRunner

from ductor_celery.cli import ductor as ductor_cli
from ductor_celery.store.db import get_engine
from ductor_celery.store.migrate import (
    current_revision,
    downgrade,
    head_revision,
    include_object,
    script_location,
    upgrade,
)
from ductor_celery.store.schema import metadata


def _diff(url: str) -> list[Any]:
    engine = get_engine(url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "include_object": include_object,
            },
        )
        return list(compare_metadata(ctx, metadata))


def test_upgrade_from_empty_matches_the_metadata(pg_server: Any) -> None:
    pg_server.create_database("mig_fresh")
    url = pg_server.url("mig_fresh")
    upgrade(url)
    assert _diff(url) == []
    assert current_revision(get_engine(url)) == head_revision(url)
    with get_engine(url).connect() as conn:
        tables = set(sa.inspect(conn).get_table_names())
    assert "eec_alembic_version" in tables and "alembic_version" not in tables


def test_downgrade_to_base_and_back(pg_server: Any) -> None:
    pg_server.create_database("mig_roundtrip")
    url = pg_server.url("mig_roundtrip")
    upgrade(url)
    downgrade(url, "base")
    with get_engine(url).connect() as conn:
        assert [t for t in sa.inspect(conn).get_table_names() if t != "eec_alembic_version"] == []
    upgrade(url)
    assert _diff(url) == []


def test_migrations_leave_the_users_own_tables_alone(pg_server: Any) -> None:
    pg_server.create_database("mig_shared")
    url = pg_server.url("mig_shared")
    with get_engine(url).begin() as conn:
        conn.execute(sa.text("CREATE TABLE alembic_version (version_num varchar(32))"))
        conn.execute(sa.text("INSERT INTO alembic_version VALUES ('users_own_rev')"))
        conn.execute(sa.text("CREATE TABLE orders (id int)"))
    upgrade(url)
    with get_engine(url).connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one() == (
            "users_own_rev"
        )
    assert _diff(url) == []


def test_sqlite_embedded_schema_matches_too(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path}/ductor.sqlite3"
    upgrade(url)
    assert _diff(url) == []


def test_cli_migrate_then_again_is_a_no_op(pg_server: Any) -> None:
    pg_server.create_database("mig_cli")
    url = pg_server.url("mig_cli")
    runner = CliRunner()
    first = runner.invoke(ductor_cli, ["migrate", "--database-url", url])
    assert first.exit_code == 0, first.output
    second = runner.invoke(ductor_cli, ["migrate", "--database-url", url])
    assert second.exit_code == 0 and "up to date" in second.output


def test_cli_migrate_against_an_unreachable_database_fails_in_one_line() -> None:
    result = CliRunner().invoke(
        ductor_cli,
        ["migrate", "--database-url", "postgresql+psycopg://nobody@127.0.0.1:1/none"],
    )
    assert result.exit_code == 1
    assert result.output.startswith("error: migration failed")
    assert len(result.output.strip().splitlines()) == 1


def test_sqlite_0005_turns_json_columns_into_text_keeping_rows_and_indexes(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path}/old.sqlite3"
    upgrade(url, "0004")
    engine = get_engine(url)

    def indexes() -> list[tuple[str, str]]:
        with engine.connect() as conn:
            return sorted(
                conn.exec_driver_sql(
                    "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
                ).fetchall()
            )

    before = indexes()
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO eec_workflow_definition (spec_hash, name, version, spec) "
            "VALUES ('h', 'w', 1, '{\"nodes\": []}')"
        )
    upgrade(url, "0005")  # 0005 only: later revisions add indexes of their own
    assert indexes() == before  # the partial unique index on open workflow ids included
    upgrade(url)
    with engine.connect() as conn:
        columns = {c["name"]: c["type"] for c in sa.inspect(conn).get_columns("eec_workflow_run")}
        spec = conn.exec_driver_sql("SELECT spec FROM eec_workflow_definition").scalar_one()
    assert all(isinstance(columns[c], sa.Text) for c in ("state", "input", "output", "error"))
    assert spec == '{"nodes": []}'
    upgrade(url)  # and on to head: the schema the code declares
    assert _diff(url) == []


# --- alembic/ at the top of the checkout and `ductor migrate` build one schema ---------------

ROOT = Path(__file__).resolve().parents[2]


def _shape(url: str) -> dict[str, Any]:
    """Every table's columns, keys, indexes and constraints, and the recorded revision."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            shape: dict[str, Any] = {
                table: {
                    "columns": [
                        (c["name"], str(c["type"]), c["nullable"], c.get("default"))
                        for c in inspector.get_columns(table)
                    ],
                    "primary_key": inspector.get_pk_constraint(table),
                    "foreign_keys": sorted(map(repr, inspector.get_foreign_keys(table))),
                    "indexes": sorted(map(repr, inspector.get_indexes(table))),
                    "unique": sorted(map(repr, inspector.get_unique_constraints(table))),
                    "checks": sorted(map(repr, inspector.get_check_constraints(table))),
                }
                for table in sorted(inspector.get_table_names())
            }
            shape["revision"] = conn.execute(
                sa.text("SELECT version_num FROM eec_alembic_version")
            ).scalar_one()
        return shape
    finally:
        engine.dispose()


def _pg_dump_schema(pg_server: Any, dbname: str) -> list[str]:
    """``pg_dump --schema-only``, without its comments and per-dump random lines."""
    result = subprocess.run(
        [
            str(pg_server.bindir / "pg_dump"),
            "--schema-only",
            "--no-owner",
            pg_server.conninfo(dbname),
        ],
        env={**os.environ, "LC_ALL": "C"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [
        line
        for line in result.stdout.splitlines()
        if line.strip() and not line.startswith(("--", "\\restrict", "\\unrestrict"))
    ]


def test_alembic_upgrade_head_from_the_checkout_builds_what_ductor_migrate_builds(
    pg_server: Any, tmp_path: Path
) -> None:
    assert (ROOT / "alembic.ini").is_file() and not (ROOT / "alembic" / "__init__.py").exists()
    assert script_location() == str(ROOT / "alembic")  # a checkout runs alembic/ itself
    pg_server.create_database("mig_alembic_ini")
    pg_server.create_database("mig_ductor_cli")
    env = {k: v for k, v in os.environ.items() if k != "DUCTOR_DATABASE_URL"}
    # As a developer would, from the repository root: `python -m alembic` puts the root first on
    # sys.path, so this also shows that alembic/ (no __init__.py) does not shadow the library.
    alembic = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", "alembic.ini"]
        + ["-x", f"url={pg_server.url('mig_alembic_ini')}", "upgrade", "head"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert alembic.returncode == 0, alembic.stdout + alembic.stderr
    assert "Running upgrade  -> 0001" in alembic.stderr
    # And as an operator would: the console script, from a directory outside the checkout.
    ductor = subprocess.run(
        [str(Path(sys.executable).parent / "ductor"), "migrate"]
        + ["--database-url", pg_server.url("mig_ductor_cli")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ductor.returncode == 0, ductor.stdout + ductor.stderr

    by_alembic = _shape(pg_server.url("mig_alembic_ini"))
    by_ductor = _shape(pg_server.url("mig_ductor_cli"))
    assert by_alembic == by_ductor
    assert by_ductor["revision"] == head_revision(pg_server.url("mig_ductor_cli"))
    assert {"eec_alembic_version", "eec_workflow_run"} <= set(by_ductor)
    assert "alembic_version" not in by_ductor
    assert _pg_dump_schema(pg_server, "mig_alembic_ini") == _pg_dump_schema(
        pg_server, "mig_ductor_cli"
    )
    assert _diff(pg_server.url("mig_alembic_ini")) == []
