"""The inference gateway's hot path: the lane that reads /v1/infer itself, the proxy, its
upstream HTTP/1.1 client, the prefix key, the rate limiter, upstream health.
"""
