"""The mixed-precision modes, shared by the autocast pass and fine-tuning (importing this needs no torch)."""

#: ``auto`` picks by device and measurement; ``off`` is full precision.
AMP_CHOICES = ("auto", "bf16", "fp16", "off")
