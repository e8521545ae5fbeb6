"""Draft checkpoints as evidence: load EAGLE-3 and DFlash drafts, measure acceptance per wiring,
infer the wiring a draft was trained on."""
