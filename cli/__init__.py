"""The ``specmesh`` command line: one module per subcommand (`main` dispatches lazily, so a
command loads only what it runs; ``specmesh router`` and ``specmesh health`` load no torch)."""
