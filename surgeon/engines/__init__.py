"""Engines: locate an installed engine, read its source (probes, the decoder-loop anatomy), and
view its per-class conventions."""
