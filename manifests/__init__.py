"""Declarative data: model layouts, fixture presets, recipes, engine profiles (read with importlib.resources)."""
