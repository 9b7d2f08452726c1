"""The registry client: etcd through aetcd, one `Registry` handle (client) over its parts (the
connection, leases and their keep-alive, paged reads, watches, guarded transactions, the
site-lifecycle transactions, maintenance), its TLS and auth (security, admin), its gRPC over
HTTP/2 (h2grpc), the paging policy, and a live mirror of one prefix.
"""
