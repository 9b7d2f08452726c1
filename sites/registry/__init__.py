"""The registry client: etcd through aetcd (lease keep-alive, paged reads, watches, the
site-lifecycle transactions), its TLS and auth (security), its gRPC over HTTP/2 (h2grpc), and
a live mirror of one prefix.
"""
