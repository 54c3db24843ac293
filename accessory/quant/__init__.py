"""Weight-only quantized formats (formats.py) and the module that holds a rank's quantized weight (weight.py)."""
