"""What MetaModel does, below its face: loading (loading.py), prompts and images made into the engine's requests
(prompts.py), scoring (scoring.py)."""
