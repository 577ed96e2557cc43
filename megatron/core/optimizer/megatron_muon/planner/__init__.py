"""Who orthogonalizes which matrix, and what every rank sends where: the exchange plan (``plan``),
owners and gangs (``placement``), the cost model of a split matrix (``cost_model``), counted
figures (``figures``), and gangs at step time (``gangs``, only where the plan splits a matrix).
"""
