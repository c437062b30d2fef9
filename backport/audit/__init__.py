"""`audit`: an operator's running SGLang against the four gates of the incident analysis.

The gates (the incident analysis's four, docs/reference.md "audit"): 1 pool versus context,
2 rejection at admission, 3 transfer covers read, 4 page lifetime. Evidence comes from two places: the
servers' own `/server_info` documents (``servers``) and the SGLang code they run, examined by
fingerprint and by the admission and prefill-retirement probes (``code``). ``gates`` turns
those facts into one verdict per gate (`pass`, `fail`, `warn`, `unknown`); a field that is
missing or cannot be read makes its gate `unknown` with the reason, never `pass`.
"""
