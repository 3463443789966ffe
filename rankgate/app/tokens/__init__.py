"""Prompt text to token ids and back, below both request preparation and responses."""
