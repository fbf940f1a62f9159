"""Optional integrations of refpipe with env-server libraries and RL frameworks.

``integrations.verifiers_server`` and ``integrations.verifiers_client`` need the
``verifiers`` extra (``pip install refpipe[verifiers]``: verifiers 0.4.x, ``verifiers.v1``);
``integrations.verl`` needs ``verl`` (tested with 0.9.1, docs/integrations.md). Nothing else in
refpipe imports them.
"""
