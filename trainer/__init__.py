"""Trainer ranks: step loading, per-rank fetch, assembly, failure all-reduce, release."""
