"""Repairs of upstream megatron-core 0.19.2 defects on the paths our Muon takes, each called by the
patch of the file it repairs (docs/upstream_repairs.md); none of them is Muon's.
"""
