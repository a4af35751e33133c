"""Expert traffic: routing statistics, the IPF coactivation model, hardware profiles and the
roofline cost model of a decode or verify step (DESIGN.md "Coactivation model and cost model").

``moespec analyze`` (:mod:`moespec.cost.analyze`) is the command line over this package; the
cost-aware tree prices draft nodes through :func:`moespec.cost.coactivation.expected_unique`.
"""
