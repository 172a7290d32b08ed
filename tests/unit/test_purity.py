"""The layer rules hold, so ``pytest`` fails on a layer violation as ``scripts/check`` does.

The rules themselves are import-linter contracts in pyproject.toml (``[tool.importlinter]``):
every import points down, engine/ and definition/ are pure, the client never imports the
runtime, store/ never imports Celery. One rule import-linter cannot state, since it sees an
outside package only as a whole, is checked here by hand: outside store/, SQLAlchemy appears
only as the ``Engine`` and ``Connection`` types.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ductor_celery

PACKAGE_ROOT = Path(ductor_celery.__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent


def test_the_import_contracts_hold() -> None:
    # A process of its own: lint-imports puts the working directory on sys.path and sets up
    # logging, neither of which belongs in the test process.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
            "--config",
            str(REPO_ROOT / "pyproject.toml"),
            "--no-cache",
            "--no-logo",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"lint-imports failed:\n{done.stdout}\n{done.stderr}"
    assert "0 broken" in done.stdout, done.stdout


# -- the database's dialect and driver live in store/ -------------------------------------------


def module_name(path: Path, root: Path = PACKAGE_ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = PACKAGE_ROOT) -> list[tuple[int, str]]:
    """Absolute names of every module ``path`` imports (relative imports resolved), and of
    every name imported from one: ``from sqlalchemy.engine import Engine`` gives both
    ``sqlalchemy.engine`` and ``sqlalchemy.engine.Engine``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                prefix = ".".join(base)
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            found.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names)
    return found


#: Outside store/, SQLAlchemy appears only as the Engine and Connection types handed around;
#: the SQL, the dialect branches and the driver's errors are store/'s business.
DIALECT_FREE = (
    "runtime",
    "client.py",
    "ductor.py",
    "cli",
    "views.py",
    "schedules.py",
    "retention.py",
    "bulk.py",
)
ALLOWED_SQLALCHEMY = {
    "sqlalchemy.engine",
    "sqlalchemy.engine.Engine",
    "sqlalchemy.engine.Connection",
}


def reaches_the_database(name: str) -> bool:
    top = name.split(".")[0]
    return (
        top in {"psycopg", "psycopg2"}
        or (top == "sqlalchemy" and name not in ALLOWED_SQLALCHEMY)
        or name.endswith(".is_postgres")
        or name == "ductor_celery.store.dialect"
        or name.startswith("ductor_celery.store.dialect.")
    )


def dialect_free_modules() -> list[Path]:
    found: list[Path] = []
    for name in DIALECT_FREE:
        path = PACKAGE_ROOT / name
        found.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return found


@pytest.mark.parametrize("path", dialect_free_modules(), ids=module_name)
def test_only_store_knows_the_dialect_and_the_driver(path: Path) -> None:
    bad = [
        f"line {line}: {name}"
        for line, name in imported_modules(path)
        if reaches_the_database(name)
    ]
    assert bad == [], f"{module_name(path)} reaches past store/ to the database: {bad}"


@pytest.mark.parametrize(
    ("source", "is_bad"),
    [
        ("from sqlalchemy.engine import Engine, Connection", False),
        ("import sqlalchemy.engine", False),
        ("from ..store.db import get_engine", False),
        ("import sqlalchemy as sa", True),
        ("from sqlalchemy.exc import IntegrityError", True),
        ("from sqlalchemy.engine import Engine, Row", True),
        ("import psycopg", True),
        ("def f():\n    from psycopg import errors\n", True),
        ("from ..store.db import is_postgres", True),
        ("from ..store import db\nfrom ..store.db import aware, is_postgres", True),
        ("from ..store.dialect import dialect_of", True),
        ("from ..store import dialect", True),
        ("from ..store.db import db_now", False),
    ],
)
def test_the_checker_itself(tmp_path: Path, source: str, is_bad: bool) -> None:
    # Lay the snippet out as a module inside a fake package so relative imports resolve.
    pkg_dir = tmp_path / "ductor_celery" / "runtime"
    pkg_dir.mkdir(parents=True)
    path = pkg_dir / "x.py"
    path.write_text(source, encoding="utf-8")
    found = imported_modules(path, root=tmp_path / "ductor_celery")
    assert any(reaches_the_database(name) for _, name in found) is is_bad, found
