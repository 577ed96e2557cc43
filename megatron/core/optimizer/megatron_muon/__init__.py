"""Our Muon (``--muon-impl megatron_muon``)."""
