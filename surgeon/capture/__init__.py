"""Capture: generated hooks, their graph-safety check, dumps, the asynchronous writer, and exporters."""
