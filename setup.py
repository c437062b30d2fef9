"""Package layout only (metadata is in pyproject.toml).

The repository keeps its folders where tests and README expect them (`patches/`, `probes/`,
`evidence/receipt.schema.json`); the installed distribution gives them names of their own, so
that nothing collides with another project's top-level `probes`:

    probes/                      -> sglang_backport_probes/ (with requirements-cpu.txt, standins/shims/)
    evidence/receipt.schema.json -> sglang_backport_data/receipt.schema.json
    patches/                     -> sglang_backport_data/patches/

`backport/resources.py` finds them through importlib.resources. Nothing at run time reads the
installed names: the probe package imports itself relatively and is started from its own folder
(probes/runtime/launch.py), so a checkout and a wheel run the same code (docs/decisions.md, "One
layout"). setup.py rather than pyproject.toml because the backport packages are discovered while the
others are mapped.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["backport", "backport.*"])
    + ["sglang_backport_probes", "sglang_backport_data", "sglang_backport_data.patches"]
    # probes/ by kind, and the probes that are packages of scenario modules (probes/cases/prefill_drain/, ...)
    + [f"sglang_backport_probes.{sub}" for sub in ("cases", "rigs", "standins", "runtime")]
    + ["sglang_backport_probes.cases.page_lifetime", "sglang_backport_probes.cases.prefill_drain"],
    package_dir={
        "sglang_backport_probes": "probes",
        "sglang_backport_data": "evidence",
        "sglang_backport_data.patches": "patches",
    },
    package_data={
        "backport.live": ["requirements-*.txt", "standins/**/*.py"],
        "sglang_backport_probes": ["requirements-cpu.txt"],
        "sglang_backport_probes.standins": ["shims/**/*.py"],
        "sglang_backport_data": ["receipt.schema.json", "receipt-format-3.schema.json", "openvex.schema.json",
                                 "osv.schema.json"],
        "sglang_backport_data.patches": ["series", "*.toml", "*/*.patch"],
    },
)
