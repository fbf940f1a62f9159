"""The pipeline: field registry, keep path, orchestrator (samples, packing, step files)."""
