"""The one rule for payloads (inputs, arguments, results, patches, signals): JSON, and at most
``ductor_max_payload_bytes`` once serialized. Client, worker and tick all apply it."""

from __future__ import annotations

import json
from typing import Any


def json_problem(value: Any, what: str, limit: int) -> tuple[Any, str | None]:
    """``value`` normalized through JSON, or ``None`` and a problem that names ``what``."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as exc:
        return None, f"{what} is not JSON-serializable: {exc}"
    if len(text) > limit:
        return None, f"{what} is {len(text)} bytes, over ductor_max_payload_bytes={limit}"
    return json.loads(text), None
