"""The lock: its schema, model and parser, the source kinds and their transports, fetching, the action key."""
