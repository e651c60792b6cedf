"""Property-based tests of every door: generated inputs, each refused by name or answered right.

A package (unlike the other test folders) so that its conftest.py is imported as
``fuzz.conftest`` and leaves ``tests/conftest.py`` the module every ``from conftest import``
finds.
"""
