"""Rigs: build the tree's own objects for a scenario (a prefill door, a transfer manager, a KV
handoff, a constructed backend) and drive them step by step. Cases share them; they register no
case (``probes.case`` refuses one outside ``probes.cases``)."""
