"""``ductor_metrics_port`` and ``ductor_metrics_host``: read like every ductor setting, and a
bad value is refused at startup with a message naming the setting."""

from __future__ import annotations

from typing import Any

import pytest

from ductor_celery.runtime import metrics
from ductor_celery.settings import Settings


def test_metrics_are_off_unless_a_port_is_set() -> None:
    settings = Settings.from_conf({})
    assert settings.metrics_port is None
    assert settings.metrics_host == "0.0.0.0"


@pytest.mark.parametrize("value", [9100, "9100"])
def test_a_port_is_read_from_an_int_or_an_env_style_string(value: Any) -> None:
    settings = Settings.from_conf({"ductor_metrics_port": value, "ductor_metrics_host": "::1"})
    assert settings.metrics_port == 9100
    assert settings.metrics_host == "::1"


@pytest.mark.parametrize("value", [0, 65536, -1, "abc", True, 9100.5])
def test_a_bad_port_names_the_setting(value: Any) -> None:
    with pytest.raises(ValueError, match="ductor_metrics_port"):
        Settings.from_conf({"ductor_metrics_port": value})


def test_recording_with_metrics_off_creates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUCTOR_METRICS_ON", raising=False)
    monkeypatch.setattr(metrics, "_on", False)  # as a process started without it reads it
    metrics.record_attempt("s", "succeeded", 0.1)
    metrics.record_claim("s", 0.1)
    metrics.record_tick("committed", 0.001, None)
    metrics.record_sweep({"timers": 1})
    assert metrics._metrics is None


def test_the_grafana_dashboard_uses_only_names_that_exist() -> None:
    """docs/grafana-dashboard.json must not drift from the names the code serves."""
    import json
    import re
    from pathlib import Path

    dashboard = json.loads(
        (Path(__file__).parents[2] / "docs" / "grafana-dashboard.json").read_text()
    )
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {
        re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs for n in re.findall(r"ductor_\w+", e)
    }
    served = {
        f"{m._name}_total" if m._type == "counter" else m._name
        for m in vars(metrics._Metrics()).values()
    }
    console_gauges = {"ductor_runs", "ductor_outbox_backlog", "ductor_lease_waiters"}
    assert used - served - console_gauges == set()
    assert served <= used  # every worker metric has a panel
