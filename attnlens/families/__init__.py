"""Built-in families, one module each; `attnlens.family.family_for` imports them lazily by model type."""
