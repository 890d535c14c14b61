"""Shared fixtures. Tier-specific fixtures live in their own plugin modules."""

pytest_plugins = ["tests.systemd_fixtures"]
