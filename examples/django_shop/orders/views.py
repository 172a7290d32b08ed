from __future__ import annotations

import json

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_POST

from .services import OutOfStock
from .services import place_order as place


@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    body = json.loads(request.body or b"{}")
    try:
        order = place(body["customer"], list(body["items"]), int(body["total"]))
    except OutOfStock as exc:
        return JsonResponse({"error": str(exc)}, status=409)
    return JsonResponse({"order": order.pk, "run_id": order.run_id}, status=201)
