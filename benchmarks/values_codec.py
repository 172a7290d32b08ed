"""Micro-benchmark of the typed-values encoding on the hot path (docs/values-and-secrets.md).

What a step's typical small, plain-JSON result costs: the payload check (which encodes), the
store's serializer, decoding it for the next step, and preparing a call's arguments (decode,
then pydantic conversion of annotated parameters). Best of 7 runs of 200,000 each, in µs.

    python benchmarks/values_codec.py            # this checkout
    python benchmarks/values_codec.py /other/checkout   # the same numbers for another tree
"""

from __future__ import annotations

import sys
import timeit
from typing import Any

if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])

from ductor_celery.payloads import check_json  # noqa: E402
from ductor_celery.store.schema import dumps_json  # noqa: E402

VALUE = {
    "charge_id": "ch_1",
    "amount": 1250,
    "currency": "eur",
    "ok": True,
    "items": [{"sku": "a-1", "qty": 2}, {"sku": "b-7", "qty": 1}],
    "note": None,
}
N = 200_000


def best(stmt: str, scope: dict[str, Any]) -> float:
    return min(timeit.repeat(stmt, number=N, repeat=7, globals=scope)) / N * 1e6


def report(label: str, stmt: str, scope: dict[str, Any]) -> None:
    sys.stdout.write(f"{label:<24}{best(stmt, scope):6.2f} us\n")


def main() -> None:
    scope: dict[str, Any] = {"check_json": check_json, "dumps_json": dumps_json, "value": VALUE}
    report("payload check (encode)", "check_json(value, 'r', 1 << 20)", scope)
    report("store serializer", "dumps_json(value)", scope)
    try:
        from ductor_celery.runtime.arguments import prepare
        from ductor_celery.values import decode
    except ImportError:  # a tree from before typed values
        return

    def annotated(ctx: Any, order: dict[str, Any], n: int) -> None: ...
    def plain(ctx: Any, order: Any, n: Any) -> None: ...

    scope |= {"decode": decode, "prepare": prepare, "a": annotated, "p": plain}
    scope["args"] = {"order": VALUE, "n": 3}
    report("decode", "decode(value)", scope)
    report("prepare, 2 annotated", "prepare(a, 's', args)", scope)
    report("prepare, unannotated", "prepare(p, 's', args)", scope)


if __name__ == "__main__":
    main()
