"""The floor: errors, console lines, files, processes, HTTP, tree hashes, settings. Imports only tasks.outside."""
