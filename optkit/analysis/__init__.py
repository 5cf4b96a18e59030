"""Measuring and reporting: layer inspection, latency, accuracy, evaluation, generation, and reports (it builds no
files; parameter and MAC counts are :mod:`optkit.model.stats`)."""
