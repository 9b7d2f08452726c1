"""The stand-in's /metrics series, named, typed and labelled as vLLM V1 writes them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["TTFT_BUCKETS_S", "VllmMetrics"]

# vLLM's own buckets for vllm:time_to_first_token_seconds (vllm/engine/metrics.py)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0)  # fmt: skip


class VllmMetrics:
    """The vLLM-named series of one server, in a registry of its own (tests run several).
    Names, types, help and labels as vLLM V1's PrometheusStatLogger (vllm/v1/metrics/
    loggers.py): every series labelled model_name and engine (one engine, "0")."""

    def __init__(self, model: str, *, lora: bool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label, values = self.registry, ("model_name", "engine"), (model, "0")
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.",
            label, registry=r,
        ).labels(*values)  # fmt: skip
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            label, registry=r,
        ).labels(*values)  # fmt: skip
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            label, registry=r,
        ).labels(*values)  # fmt: skip
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            label, registry=r, buckets=TTFT_BUCKETS_S,
        ).labels(*values)  # fmt: skip
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
            "tokens.", label, registry=r,
        ).labels(*values)  # fmt: skip
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            label, registry=r,
        ).labels(*values)  # fmt: skip
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", label, registry=r,
        ).labels(*values)  # fmt: skip
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", label, registry=r,
        ).labels(*values)  # fmt: skip
        # as vLLM: only a server with LoRA enabled has it; no model_name label
        self.lora_info = (
            Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                registry=r,
            )  # fmt: skip
            if lora
            else None
        )
