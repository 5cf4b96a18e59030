"""Measuring models: parameter and MAC counts, layer inspection, latency, and reports."""
