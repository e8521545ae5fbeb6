"""Facts read from engine and trainer source: norm flags, MTP heads and inputs, DFlash trainers, cited tables."""
