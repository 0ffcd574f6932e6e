"""The `tpla` command line (DESIGN §3): one module per group of sub-commands."""
