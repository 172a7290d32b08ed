from django.apps import AppConfig


class OrdersConfig(AppConfig):
    name = "orders"

    def ready(self) -> None:
        # Creates the Ductor (settings are loaded now) and registers the steps and workflow.
        from . import workflows  # noqa: F401
