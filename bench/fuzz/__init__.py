"""A fuzzer of hostile input by volume (issue 21): `python -m bench.fuzz`. See __main__.py."""
