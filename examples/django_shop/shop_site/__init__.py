"""A minimal Django project whose orders start durable ductor runs in their own transaction.

The Celery app is not imported here (the usual ``from .celery import app``): ``Ductor(app)``
reads the settings when it is created, so it is created once Django's settings are loaded, by
``orders.apps.OrdersConfig.ready()``.
"""
