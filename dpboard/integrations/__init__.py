"""Engines at the edge: one folder per engine, each a thin adapter that imports its engine lazily."""
