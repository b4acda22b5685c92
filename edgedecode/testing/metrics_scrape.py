"""A server's Prometheus metrics as the tests and benchmarks read them."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape_metrics(url: str, token: str = "", path: str = "/metrics", timeout: float = 30.0) -> dict[str, float]:
    """Every sample of the server at ``url``'s ``path`` (parsed by prometheus-client), keyed
    ``name{k=v,...}`` with the labels sorted (``name{}`` for none); ``token`` as a bearer token."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=timeout) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples
