"""Optional integrations of refpipe with env-server libraries (``pip install refpipe[verifiers]``).

``integrations.verifiers_server`` and ``integrations.verifiers_client`` need the
``verifiers`` extra (verifiers 0.4.x, ``verifiers.v1``); nothing else in refpipe imports them.
"""
