"""Reading engine source, never imported: locate the package, index its files, the decoder-loop anatomy, pure evaluation."""
