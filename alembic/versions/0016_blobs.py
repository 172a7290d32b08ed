"""Large values by reference: eec_blob

A value over ``ductor_offload_bytes`` is stored once in ``eec_blob``, in chunks of about 1 MiB
(``seq`` orders them; ``first_item``: an offloaded list's chunk holds whole items from that
index), and the row that would have held it holds a reference (docs/large-values.md).
``run_id`` is the run whose row first held it: prune deletes blobs with their run.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 04:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "eec_blob",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("first_item", sa.Integer, nullable=True),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.create_index("eec_blob_run", "eec_blob", ["run_id"])


def downgrade() -> None:
    op.drop_index("eec_blob_run", table_name="eec_blob")
    op.drop_table("eec_blob")
