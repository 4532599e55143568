"""Helpers shared by the test suites: reference models, factories, rank bodies of the
distributed tests, and runners for scripts.

Importable because pytest puts ``test/`` on ``sys.path`` (``pythonpath`` in
pyproject.toml); processes spawned from a test inherit that path, and scripts run
through ``scripts.run_python`` get it in ``PYTHONPATH``.
"""
