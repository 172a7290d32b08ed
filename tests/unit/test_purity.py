"""engine/ and definition/ stay pure: no database, broker, store or runtime imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ductor_celery

PACKAGE_ROOT = Path(ductor_celery.__file__).resolve().parent
PURE_PACKAGES = ("engine", "definition")
FORBIDDEN_TOP_LEVEL = {"sqlalchemy", "celery", "kombu", "psycopg", "psycopg2", "redis"}
FORBIDDEN_INTERNAL = {"store", "runtime"}


def pure_modules() -> list[Path]:
    return sorted(p for pkg in PURE_PACKAGES for p in (PACKAGE_ROOT / pkg).rglob("*.py"))


def module_name(path: Path, root: Path = PACKAGE_ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = PACKAGE_ROOT) -> list[tuple[int, str]]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
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
            # ``from .. import store`` names the module in the alias list.
            found.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names)
    return found


def forbidden(name: str) -> bool:
    parts = name.split(".")
    if parts[0] in FORBIDDEN_TOP_LEVEL:
        return True
    return len(parts) >= 2 and parts[0] == "ductor_celery" and parts[1] in FORBIDDEN_INTERNAL


def test_the_pure_packages_have_modules() -> None:
    names = {module_name(p) for p in pure_modules()}
    assert {"ductor_celery.engine.tick", "ductor_celery.definition.builder"} <= names


@pytest.mark.parametrize("path", pure_modules(), ids=module_name)
def test_pure_module_imports_nothing_impure(path: Path) -> None:
    bad = [f"line {line}: {name}" for line, name in imported_modules(path) if forbidden(name)]
    assert bad == [], f"{module_name(path)} imports impure modules: {bad}"


@pytest.mark.parametrize(
    ("source", "module", "is_bad"),
    [
        ("import sqlalchemy as sa", "ductor_celery.engine.x", True),
        ("from celery import Celery", "ductor_celery.engine.x", True),
        ("import kombu.utils", "ductor_celery.engine.x", True),
        ("from psycopg import sql", "ductor_celery.definition.x", True),
        ("import redis", "ductor_celery.definition.x", True),
        ("from ..store import runs", "ductor_celery.engine.x", True),
        ("from ..runtime.dispatch import send", "ductor_celery.engine.x", True),
        ("from .. import store", "ductor_celery.engine.x", True),
        ("from ductor_celery.store.db import engine", "ductor_celery.engine.x", True),
        ("import ductor_celery.runtime", "ductor_celery.engine.x", True),
        ("def f():\n    import celery\n", "ductor_celery.engine.x", True),
        ("from ..definition.spec import WorkflowSpec", "ductor_celery.engine.x", False),
        ("from .state import RunState", "ductor_celery.engine.x", False),
        ("from ..errors import DefinitionError", "ductor_celery.engine.x", False),
        ("import json, hashlib", "ductor_celery.engine.x", False),
        ("import storefront", "ductor_celery.engine.x", False),
    ],
)
def test_the_checker_itself(tmp_path: Path, source: str, module: str, is_bad: bool) -> None:
    # Lay the snippet out as a module inside a fake package so relative imports resolve.
    parts = module.split(".")
    pkg_dir = tmp_path.joinpath(*parts[:-1])
    pkg_dir.mkdir(parents=True)
    path = pkg_dir / f"{parts[-1]}.py"
    path.write_text(source, encoding="utf-8")
    found = imported_modules(path, root=tmp_path / "ductor_celery")
    assert any(forbidden(name) for _, name in found) is is_bad, found


# -- the database's dialect and driver live in store/ -------------------------------------------

#: Outside store/, SQLAlchemy appears only as the Engine and Connection types handed around;
#: the SQL, the dialect branches and the driver's errors are store/'s business.
DIALECT_FREE = ("runtime", "client.py", "ductor.py", "cli.py", "views.py")
ALLOWED_SQLALCHEMY = {
    "sqlalchemy.engine",
    "sqlalchemy.engine.Engine",
    "sqlalchemy.engine.Connection",
}


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
        if name.split(".")[0] in {"psycopg", "psycopg2"}
        or (name.split(".")[0] == "sqlalchemy" and name not in ALLOWED_SQLALCHEMY)
        or name.endswith(".is_postgres")
    ]
    assert bad == [], f"{module_name(path)} reaches past store/ to the database: {bad}"
