"""Command line: `refpipe run|audit|sweep|inspect|show|ls|verify`."""

# This folder installs as refpipe.cli only: a copy under a bare name would hold types that are not refpipe's.
if __name__ != "refpipe.cli":
    raise ImportError(f"{__name__}: refpipe's cli/ folder imported under a bare name (the repository root "
                      "is on sys.path); import refpipe.cli instead", name=__name__)
