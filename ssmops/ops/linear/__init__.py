"""The weight-only linear layer of decoding (`weight_only_linear`): y = x @ (weight * scale).T + bias
with the weight stored as float32, bfloat16, float16 or int8 (a float32 scale per output
feature). Files: schema.py, checks.py, reference.py, default.py; the C++ kernel is
ssmops/csrc/linear/."""

from .._family import Family, Operator
from . import default, schema

FAMILY = Family(operators=(Operator(schema.SCHEMA, schema.fake, default.weight_only_linear,
                                    onnx=default.weight_only_linear),))
