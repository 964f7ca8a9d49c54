"""The runtime image, its layers, exports and bundles, and the tool's own wheels."""
