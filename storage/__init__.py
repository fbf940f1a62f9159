"""Storage side of refpipe: run URIs, the store, the chunk codec, fetch and the ledger."""

# This folder installs as refpipe.storage only: a copy under a bare name would hold types that are not refpipe's.
if __name__ != "refpipe.storage":
    raise ImportError(f"{__name__}: refpipe's storage/ folder imported under a bare name (the repository root "
                      "is on sys.path); import refpipe.storage instead", name=__name__)
