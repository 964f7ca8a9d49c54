"""Code that runs elsewhere (the compiler gate, on a node, in the verification venv): the standard library only."""
