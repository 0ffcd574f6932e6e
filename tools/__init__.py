"""Everything that is not a service: the `tpla` command line, benchmarks, the demo trainer and
the local stack the tests and benchmarks start. Nothing under common/ or services/ imports it."""
