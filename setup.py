"""Build of the one C extension; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("pg2delta.decode._tuples", sources=["src/pg2delta/decode/_tuples.c"]),
    ],
)
