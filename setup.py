"""Build the C extensions (src/weightsync/_native): large copies with non-temporal stores, and
delta sync's one-pass diff.

Both are optional: without a C compiler the install still succeeds and weightsync falls back to
numpy (slower on large same-host transfers and delta diffs; see docs/benchmarks.md, docs/delta.md).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "weightsync._native.streamcopy",
            sources=["src/weightsync/_native/streamcopy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "weightsync._native.deltadiff",
            sources=["src/weightsync/_native/deltadiff.c"],
            extra_compile_args=["-O2", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
    ]
)
