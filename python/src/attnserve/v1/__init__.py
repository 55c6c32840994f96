"""Generated gRPC stubs of the attnserve.v1 wire contract (proto/attnserve/v1/*.proto).

The modules here (attention_pb2, attention_pb2_grpc, and one pair per further
.proto) are written at build time by python/setup.py; none is in the repository.
"""
