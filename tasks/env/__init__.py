"""What a build runs in: compilers, the toolchain fingerprint, hermetic tools, the runtime closure, containers."""
