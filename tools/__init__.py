"""Maintainer tools (not shipped): they write docs/generated/ and tests/data/ from the pack and from
measurements, and the tests read what they wrote. Run from the checkout: `.venv/bin/python -m tools.NAME`."""
