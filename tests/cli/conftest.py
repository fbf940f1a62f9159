"""The CLI tests share the small real runs built in ``test_inspect`` (fixtures ``run`` and ``local_run``)."""

from tests.cli.test_inspect import local_run, run  # noqa: F401 (fixtures, registered for every test module here)
