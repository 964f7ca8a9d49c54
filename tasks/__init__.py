"""Build pinned CUDA training stacks into a verified, content-addressed wheelhouse."""
