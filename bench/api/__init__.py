"""The batching API: ingest and serve throughput and latency, ours against atroposlib's
(``throughput``).
"""
