"""Django set up once for the example's tests, on a throwaway database unless one is given
(``SHOP_DATABASE_URL``: tests/integration/test_django_shop.py passes SQLite and PostgreSQL)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
if "SHOP_DATABASE_URL" not in os.environ:
    os.environ["SHOP_DATABASE_URL"] = f"sqlite:///{tempfile.mkdtemp()}/shop.sqlite3"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop_site.settings")

import django  # noqa: E402

django.setup()


@pytest.fixture(scope="session", autouse=True)
def migrated() -> None:
    from django.core.management import call_command
    from shop_site.celery import ductor

    ductor.migrate()  # ductor's eec_ tables, beside the shop's
    call_command("migrate", verbosity=0)
