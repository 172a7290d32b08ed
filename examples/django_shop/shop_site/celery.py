"""The Celery app and its Ductor, configured from Django's settings.

Workers: ``celery -A shop_site.celery worker -Q ductor-steps,ductor-coord`` from this
directory (Celery's Django fixup sets Django up, which registers the workflows).
"""

from __future__ import annotations

import os

from celery import Celery

from ductor_celery import Ductor

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop_site.settings")

app = Celery("shop_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
ductor = Ductor(app)
