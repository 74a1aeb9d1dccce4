"""Parallel layouts and process groups."""
