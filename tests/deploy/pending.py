"""What the deploy recipes need from wprepd that it does not provide yet.

Every entry is printed at the end of the run. A check that needs a pending metric is an
expected failure (strict): once the metric is exported, the check passes, pytest reports
XPASS as a failure, and the entry must be removed here. Flags are never pending: a flag
the manifests use and `wprepd --help` lacks fails its test.
"""

PENDING_METRICS = {}


def pending_in(expr):
    """The pending metrics an expression names."""
    return sorted(m for m in PENDING_METRICS if m in expr)
