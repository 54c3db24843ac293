"""Weight-only quantized formats (formats.py): quantize, dequantize, pack; pure torch. The module that holds a
rank's quantized weight is parallel/quantized_weight.py."""
