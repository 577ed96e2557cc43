"""Our Muon (``--muon-impl megatron_muon``), by role; ``megatron.core.optimizer.muon`` is the public
entry. A step runs ``optimizer`` (the torch Muon) or ``distrib_optimizer`` (inside Megatron's
DistributedOptimizer), the math (``functional``, ``newton_schulz``) and the ``exchange``; ``tp``
at TP > 1. ``config`` holds every default; ``factory`` picks Muon's params and builds the
optimizer; ``layout`` and ``checkpoint*`` serve DDP's buffers and resumes. ``planner`` places the
Newton-Schulz work (construction only, and gangs where a matrix is split).
Map: docs/muon_in_megatron.md.
"""
