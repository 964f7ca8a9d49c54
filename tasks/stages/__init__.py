"""A run's stages: the shared Context, patching, building, the wheelhouse and its attestations."""
