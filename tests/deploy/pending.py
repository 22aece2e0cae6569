"""What the deploy recipes need from wprepd that it does not provide yet.

Every entry is printed at the end of the run. A check that needs a pending metric is an
expected failure (strict): once the metric is exported, the check passes, pytest reports
XPASS as a failure, and the entry must be removed here. Flags are never pending: a flag
the manifests use and `wprepd --help` lacks fails its test.
"""

PENDING_METRICS = {
    "wprep_health_serving": "gauge, no labels: 1 while grpc.health.v1 answers SERVING for "
    "\"\" (after the warm-up, until a drain), else 0 (alert WprepdNotServing)",
    "wprep_device_budget_bytes": "gauge {device}: --max-device-bytes for each GPU, 0 = "
    "unlimited (alert WprepdPeakDeviceBytesNearBudget, Device memory panel)",
    "wprep_device_memory_waiting_requests": "gauge {device}: requests waiting for device "
    "memory now (alert WprepdRequestsWaitingForMemory, In-flight work panel)",
    "wprep_device_memory_waits_total": "counter {device}: requests that had to wait for "
    "device memory (recording rule instance_device:wprep_device_memory_waits:rate5m)",
}


def pending_in(expr):
    """The pending metrics an expression names."""
    return sorted(m for m in PENDING_METRICS if m in expr)
