"""gRPC: generated stubs (common.rpc.gen, built by proto/build.py) and thin typed clients."""
