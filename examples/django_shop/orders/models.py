from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=100)
    total = models.PositiveIntegerField()
    status = models.CharField(max_length=20, default="placed")
    #: The ductor run that fulfils the order, started in the transaction that placed it.
    run_id = models.CharField(max_length=64, blank=True, default="")
