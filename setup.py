"""Only the optional C accelerator of the ring's task write; everything else is in pyproject.toml.

``optional=True``: without a working compiler the install still succeeds and ``otel_kvtrace.record.ring``
uses its pure-Python path (``docs/export.md``, "Native task packer").
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("otel_kvtrace.record._ringpack", ["otel_kvtrace/record/_ringpack.c"], optional=True)])
