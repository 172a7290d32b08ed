"""The Django example (examples/django_shop) runs its own tests as a user would, in a process
of its own (Django's settings are process-wide): on SQLite and on PostgreSQL, Django and ductor
sharing the one database, so an order and its run commit or roll back together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import ROOT_DIR

pytestmark = pytest.mark.e2e

PROJECT = Path(ROOT_DIR) / "examples" / "django_shop"


@pytest.fixture(params=["sqlite", "postgresql"])
def shop_database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/shop.sqlite3"
    found: str = request.getfixturevalue("database_url")  # ductor's schema is there already
    return found


def test_the_django_shop_example_passes_its_tests(shop_database: str) -> None:
    env = {
        **os.environ,
        "SHOP_DATABASE_URL": shop_database,
        "PYTHONPATH": os.pathsep.join([str(ROOT_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "5 passed" in result.stdout
