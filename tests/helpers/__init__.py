"""Helpers shared by tests of several tiers (no fixtures here)."""
