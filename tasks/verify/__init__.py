"""Proving what was built: checks of the wheelhouse and the image, linkage, reproducibility."""
