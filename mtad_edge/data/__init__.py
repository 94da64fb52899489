"""Data files shipped with mtad-edge (the default benchmark prompts)."""
