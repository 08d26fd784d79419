"""Command-line tools: python -m hybrid.tools.<name>."""
