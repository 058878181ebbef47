"""The operator families, one folder each: schema, checks, reference, one file per backend.

Adding a family is adding its folder and its line here; the registry reads this tuple.
"""

from . import causal_conv1d, linear, mamba_step, selective_scan, ssd, state_update

FAMILIES = (selective_scan.FAMILY, state_update.FAMILY, ssd.FAMILY, linear.FAMILY, mamba_step.FAMILY,
            causal_conv1d.FAMILY)
# operator name -> schema, every family's (the C++ library declares the same)
SCHEMAS = {op.name: op.schema for family in FAMILIES for op in family.operators}
