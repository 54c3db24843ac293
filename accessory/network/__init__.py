"""The neural network: the shared blocks (components.py), one decoder and each family's differences (LLM/), the
vision tower (vision.py), and whether a config's weights fit this machine (memory.py). Built on the parallel layers;
knows nothing of files, tokenizers or generation."""
