"""Scatter only: ``run.py --scatter-only`` under its old name and flags.

Usage (from the repo root)::

    .venv/bin/python benchmarks/scatter.py                 # 1,000 and 10,000 items
    .venv/bin/python benchmarks/scatter.py --sizes 1000 --no-raw

The scatter phases now live in ``benchmarks/run.py`` (``--scatter-sizes``, ``--no-raw-group``,
``--batched-items``, ``--memory-scatters``): each size is one ductor run of ``bench_scatter``
against a raw Celery ``group`` of as many no-op tasks with results. Any other ``run.py`` flag
passes through, e.g. ``--batched-items 0`` or ``--eager-modes off``.
"""

from __future__ import annotations

import argparse
import sys

import run  # benchmarks/run.py


def translate(argv: list[str]) -> list[str]:
    """This script's old flags as run.py's."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--no-raw", "--no-chord", action="store_true", help="skip the raw groups")
    p.add_argument("--timeout", type=float, default=300.0, help="per scatter, seconds")
    p.add_argument("--output", default=str(run.BENCH_DIR / "scatter_results.json"))
    args, rest = p.parse_known_args(argv)
    out = ["--scatter-only", "--scatter-sizes", *map(str, args.sizes)]
    out += ["--scatter-timeout", str(args.timeout), "--output", args.output]
    if args.no_raw:
        out.append("--no-raw-group")
    return out + rest


def main(argv: list[str] | None = None) -> int:
    return run.main(translate(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
