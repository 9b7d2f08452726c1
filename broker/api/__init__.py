"""HTTP only: the app factory, one module per resource, the inference handlers, the
dashboard, the OpenAPI document, request bodies, and who may do what (access).

The top layer of broker/ but the server (docs/architecture.md): it turns requests into calls on
the process (broker.process) and the layers below, and holds no policy of its own.
"""
