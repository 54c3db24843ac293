"""What MetaModel does, below its face: loading (loading.py, with its options in load_options.py), prompts and images
made into the engine's requests (prompts.py, images.py), scoring (scoring.py)."""
