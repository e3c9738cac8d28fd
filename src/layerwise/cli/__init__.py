"""Command-line interface: one module per subcommand, assembled in :mod:`layerwise.cli.main`."""
