"""Patch: recipes, the rewriter that puts captures into an engine model file, the journaled
patch manager, and coverage."""
