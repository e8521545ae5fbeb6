"""Engines: an installed engine read from its source, never imported, in four wings (``source``,
``interp``, ``probes``, ``facts``); :mod:`surgeon.engines.view` is the front door (which convention
applies, per engine)."""
