"""Build the one C extension: large copies with non-temporal stores (src/weightsync/_native).

It is optional: without a C compiler the install still succeeds and weightsync copies with
numpy (slower on large same-host transfers; see docs/benchmarks.md).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "weightsync._native.streamcopy",
            sources=["src/weightsync/_native/streamcopy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
