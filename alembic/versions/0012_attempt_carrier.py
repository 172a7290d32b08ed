"""The Celery message an attempt runs under: ``carrier`` on an attempt row

The task id of the message whose worker process runs the attempt: its own token for an
attempt claimed from its step message, the id of the message that began the inline chain for
an attempt run inline or held (another step's token, or ``<run id>:first_tick``). A terminate
or a run deadline revokes the carriers of the attempts it closes with ``terminate=True``, so
a step with no message of its own is killed as one with a message is. NULL on rows claimed
before it (and on attempts never claimed).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.add_column(sa.Column("carrier", sa.String(300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("eec_workflow_step_attempt", schema=None) as batch_op:
        batch_op.drop_column("carrier")
