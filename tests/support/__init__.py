"""Helpers the test modules share (functions, constants, small models and callbacks), one module per topic; the
shared pytest fixtures are in tests/conftest.py. A test module imports from here, never from another test module
(tests/test_imports.py checks).
"""
