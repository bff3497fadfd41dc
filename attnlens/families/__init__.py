"""Built-in families, one module each; `attnlens.registry` imports them lazily and serves each family's
`model_types`."""
