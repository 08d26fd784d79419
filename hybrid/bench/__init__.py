"""Benchmarks: python -m hybrid.bench.<name>, printing ratios measured side by side."""
