"""refpipe's test suite, one package: tests import each other as ``tests.<folder>.<module>``.

``tests/helpers/`` holds what several folders share (S3 servers, fault injectors, free ports, forged step
files, checkpoint rows); a helper used by one folder sits next to its tests. pytest finds the package from
the repository root (``python -m pytest`` there); a test that starts one of these modules in its own
process uses ``tests.helpers.children``.
"""
