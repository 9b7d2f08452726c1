"""The stand-in model server (an OpenAI-style server with service times, a queue and a KV
cache), for the demo, the tests and the benchmarks: no GPU here.
"""
