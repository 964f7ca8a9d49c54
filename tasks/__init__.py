"""Build pinned CUDA training stacks into a verified, content-addressed wheelhouse.

The package is ten layers, each a subpackage that imports only the layers before it in :data:`LAYERS`
(tests/unit/test_layers.py checks every import, those inside functions and under ``TYPE_CHECKING`` too;
docs/development.md's floor plan lists each layer's modules and is checked against this tree).
"""

#: The layers, lowest first: a module of one may import modules of its own layer and of those before it.
LAYERS = ("outside", "core", "store", "lock", "env", "engine", "stages", "image", "verify", "cli")
