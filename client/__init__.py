"""Command-line client for the served models: ``python -m client.generate --help``."""
