"""Wiring: what a spec means to each engine and draft (lint, render, explain, pins, check-draft, review)."""
