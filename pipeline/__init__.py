"""The pipeline: field registry, keep path, orchestrator (samples, packing, step files)."""

# This folder installs as refpipe.pipeline only: a copy under a bare name would hold types that are not refpipe's.
if __name__ != "refpipe.pipeline":
    raise ImportError(f"{__name__}: refpipe's pipeline/ folder imported under a bare name (the repository root "
                      "is on sys.path); import refpipe.pipeline instead", name=__name__)
