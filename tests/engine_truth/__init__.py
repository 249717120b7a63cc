"""Engine truth: run the serving engines' own exclusion code, from their released wheels, against mxforge.

Not a test module: the conformance tests (tests/validation/test_engine_conformance.py) and the release survey
(`python tests/engine_truth/survey.py`) use it. Nothing here is part of the mxforge package, and no
engine code is copied: it is fetched from PyPI at test time and executed in a subprocess per release.
"""
