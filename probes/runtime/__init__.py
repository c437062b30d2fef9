"""The probe child's runtime: the launcher (``python PACKAGE/runtime/launch.py ENTRY ...``, which
registers the package from its own folder), the harness, the matrix runner, the caches it installs
(bytecode, source blocks, generated code) and the preload."""
