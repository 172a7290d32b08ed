"""Create or upgrade the ``eec_`` schema with ductor's own Alembic migrations.

The migrations live at the top of the repository in the standard Alembic layout
(``alembic/``, with ``alembic.ini`` next to it), so ``alembic upgrade head`` works from a
checkout. The wheel carries the same files inside the package as ``ductor_celery/_alembic/``
(``setup.py`` maps that package onto the top-level directory at build time): installed, the
package finds them there; in a checkout or an editable install, in ``alembic/``.
"""

from __future__ import annotations

import threading
from importlib import resources
from pathlib import Path
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


def script_location() -> str:
    """The migration scripts: the wheel's copy inside the package, else the checkout's."""
    if (resources.files("ductor_celery") / "_alembic" / "env.py").is_file():
        return "ductor_celery:_alembic"  # an Alembic package resource: an installed wheel
    root = Path(__file__).resolve().parents[2]
    # alembic.ini as well: installed, the directory above the package is site-packages, whose
    # "alembic" is the Alembic library itself.
    if (root / "alembic.ini").is_file() and (root / "alembic" / "env.py").is_file():
        return str(root / "alembic")
    raise RuntimeError(
        "ductor's migrations are missing: neither ductor_celery/_alembic/ (installed) nor "
        f"alembic/ next to alembic.ini in {root} (a checkout) has an env.py"
    )


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", script_location().replace("%", "%%"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


#: Alembic runs a migration through module-level proxies (``alembic.op``, ``alembic.context``):
#: two threads migrating at once (an embedded app's first use in a worker thread while its
#: main thread migrates) tear each other's proxy down mid-migration. One at a time per process.
_ALEMBIC_LOCK = threading.RLock()


#: The oldest SQLite the schema works on: the attempt table has stored generated columns
#: (migration 0019), which SQLite has from 3.31 (2020) on.
OLDEST_SQLITE = (3, 31, 0)


def require_sqlite_version(engine: Engine) -> None:
    """A clear error, before anything is written, on a SQLite too old for the schema
    (without it, the migration would fail halfway with SQLite's own syntax error)."""
    import sqlite3

    from .dialect import SQLITE, dialect_of

    if dialect_of(engine) is not SQLITE:
        return
    if sqlite3.sqlite_version_info < OLDEST_SQLITE:
        raise RuntimeError(
            f"ductor needs SQLite {'.'.join(map(str, OLDEST_SQLITE))} or later for its "
            f"embedded database; this Python's sqlite3 module is SQLite "
            f"{sqlite3.sqlite_version}. Use a Python built with a newer SQLite, or PostgreSQL "
            "(--database-url postgresql+psycopg://...)"
        )


def upgrade(url: str, revision: str = "head") -> None:
    cfg = alembic_config(url)
    engine = get_engine(url, prepare=False)  # not hot; and safe behind any pooler
    require_sqlite_version(engine)
    with _ALEMBIC_LOCK, engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(url: str, revision: str) -> None:
    cfg = alembic_config(url)
    engine = get_engine(url, prepare=False)  # not hot; and safe behind any pooler
    with _ALEMBIC_LOCK, engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def head_revision(url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def create_throwaway(url: str) -> Engine:
    """A fresh SQLite database at ``url`` with the schema at head, made fast for the test
    harness (``ductor_celery.testing``): the tables from ``store/schema.py``'s metadata (the
    migrations' head, as tests/integration/test_migrations.py checks) instead of replaying
    every migration, and no fsync (the file is deleted when the harness exits)."""
    from sqlalchemy import event

    from . import history
    from .schema import metadata

    engine = get_engine(url)
    from .dialect import SQLITE, dialect_of

    if dialect_of(engine) is not SQLITE:
        raise ValueError("a throwaway database is a SQLite file")
    require_sqlite_version(engine)

    @event.listens_for(engine, "connect")
    def _no_fsync(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA synchronous=OFF")
        cur.close()

    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(history.CREATE_VIEW)  # a view: not in the metadata
    return engine
