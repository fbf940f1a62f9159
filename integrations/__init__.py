"""Optional integrations of refpipe with env-server libraries and RL frameworks.

``integrations.verifiers_server`` and ``integrations.verifiers_client`` need the
``verifiers`` extra (``pip install refpipe[verifiers]``: verifiers 0.4.x, ``verifiers.v1``);
``integrations.verl`` needs ``verl`` (tested with 0.9.1, docs/integrations.md). Nothing else in
refpipe imports them.
"""

# This folder installs as refpipe.integrations only: a copy under a bare name would hold types that are not refpipe's.
if __name__ != "refpipe.integrations":
    raise ImportError(f"{__name__}: refpipe's integrations/ folder imported under a bare name (the repository root "
                      "is on sys.path); import refpipe.integrations instead", name=__name__)
