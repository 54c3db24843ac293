"""The library's face: `MetaModel` (meta.py), importable as `accessory.model.meta.MetaModel` as LLaMA2-Accessory's
scripts import it."""
