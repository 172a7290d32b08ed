"""Create or upgrade the ``eec_`` schema with the migrations shipped inside the package."""

from __future__ import annotations

from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from .db import get_engine

VERSION_TABLE = "eec_alembic_version"


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic compares only ductor's own tables, never the user's (nor its version table)."""
    if type_ == "table":
        return bool(name and name.startswith("eec_") and name != VERSION_TABLE)
    return True


def alembic_config(url: str) -> Config:
    cfg = Config()
    # A package resource, so it works from an installed wheel as well as a checkout.
    cfg.set_main_option("script_location", "ductor_celery:_migrations")
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    cfg = alembic_config(url)
    engine = get_engine(url)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(url: str, revision: str) -> None:
    cfg = alembic_config(url)
    engine = get_engine(url)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def head_revision(url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()
