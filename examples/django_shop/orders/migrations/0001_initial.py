from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Order",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("customer", models.CharField(max_length=100)),
                ("total", models.PositiveIntegerField()),
                ("status", models.CharField(default="placed", max_length=20)),
                ("run_id", models.CharField(blank=True, default="", max_length=64)),
            ],
        ),
    ]
