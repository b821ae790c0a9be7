"""Only the optional C accelerators (the ring's task write and the forward's release; the probes' bytes sum, enqueue
record take, gate rule and save after-stamp); the rest is in pyproject.toml.

``optional=True``: without a working compiler the install still succeeds and ``otel_kvtrace.record.ring``
uses its pure-Python path (``docs/export.md``, "Native task packer").
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("otel_kvtrace.record._ringpack", ["otel_kvtrace/record/_ringpack.c"], optional=True),
    # the recv probes' bytes sum (instrument/proxies.total_bytes), the enqueue's record take
    # (instrument/wrappers.take_rule), the gate rule (wrappers.gate_rule) and the save after-stamp
    # (instrument/rewrite.save_rule); without it the Python rules are used
    Extension("otel_kvtrace.instrument._probes", ["otel_kvtrace/instrument/_probes.c"], optional=True),
])
