"""The demo model: a small ResNet trained on Fashion-MNIST (92.4% test accuracy), shipped with optkit.

``fashion_resnet.pt`` is an optkit slimmed checkpoint of
:class:`~optkit.demo.fashion_resnet.FashionResNet`, trained by
``benchmarks/accuracy.py --retrain --baseline-only``; ``make demo`` prunes it to half its MACs.
"""

from pathlib import Path

#: The trained checkpoint (``optkit optimize`` reads it like any model.pt).
FASHION_RESNET = Path(__file__).with_name("fashion_resnet.pt")
