"""Measurements of running steps (memory)."""
