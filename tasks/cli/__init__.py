"""The commands: doit's task graph, the reprostack command, doit lock and doit plan."""
