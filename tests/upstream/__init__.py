"""MXNet 1.9.1's own unit tests, run against this project's classes (see conftest.py)."""
