"""Settings of the shop: Django's, Celery's (``CELERY_*``) and ductor's (``CELERY_DUCTOR_*``).

Celery reads every ``CELERY_``-prefixed setting here (``app.config_from_object(
"django.conf:settings", namespace="CELERY")``), the prefix removed: ``CELERY_BROKER_URL`` is
``broker_url``, and ``CELERY_DUCTOR_DATABASE_URL`` is ``ductor_database_url``. Ductor reads its
settings from the Celery app, so that is all it takes.

One database for both: ductor's tables live beside the shop's, so an order and its run are
written in one transaction (``ductor.start(..., using="default")``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

BASE_DIR = Path(__file__).resolve().parent.parent

#: One URL for the shop's database, shared by Django and ductor (SQLite or PostgreSQL).
DATABASE_URL = os.environ.get("SHOP_DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}")


def django_database(url: str) -> dict[str, Any]:
    """Django's DATABASES entry for a SQLAlchemy URL."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": parsed.database,
            # Writers take the lock up front, as ductor's own SQLite transactions do.
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
        }
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parsed.database,
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "",
        "PORT": str(parsed.port or ""),
    }


SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "django-shop-example-not-a-secret")
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
INSTALLED_APPS = ["django.contrib.contenttypes", "orders"]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "shop_site.urls"
DATABASES = {"default": django_database(DATABASE_URL)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

# -- Celery (namespace CELERY) -------------------------------------------------------------------
CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL", "memory://")

# -- ductor, read the Celery way (CELERY_DUCTOR_<SETTING> is ductor_<setting>) ------------------
CELERY_DUCTOR_DATABASE_URL = DATABASE_URL
CELERY_DUCTOR_DEFAULT_STEP_TIMEOUT = 60
