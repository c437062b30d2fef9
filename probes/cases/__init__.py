"""The probes: one module (or package of scenario modules) per probe, each case registered with
``probes.case``. A case module imports rigs, stand-ins and ``probes`` itself, never another case
module (tests/test_probe_layout.py): what two probes share is a rig."""
