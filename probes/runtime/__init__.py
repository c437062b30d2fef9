"""The probe child's runtime: the harness (``python -m probes.runtime.harness``), the matrix runner
(``python -m probes.runtime.matrix``), the caches it installs (bytecode, source blocks, generated
code), the preload, and ``server_info`` (a tree's ``/server_info`` document, for the audit test)."""
