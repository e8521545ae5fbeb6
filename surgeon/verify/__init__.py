"""Verify: HF references, fingerprints, slot identification, subjects and the pytest plugin."""
