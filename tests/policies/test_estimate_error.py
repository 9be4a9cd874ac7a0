"""The audit's measure of an estimate's error: totals, their ratio and the extremes, per model."""

from __future__ import annotations

from policies.estimate import PromptEstimator


def test_the_audit_reports_the_estimates_ratio_to_the_billed_count() -> None:
    estimator = PromptEstimator()
    assert estimator.describe("claude")["audit"]["ratio"] is None  # nothing settled yet
    estimator.audit("claude", 80, 100, "estimate")  # a provider billed more than the estimate
    estimator.audit("claude", 330, 300, "estimate")
    estimator.audit("claude", 5, 0, "estimate")  # a usage of 0 tokens has no ratio
    audit = estimator.describe("claude")["audit"]
    assert (audit["counted_tokens"], audit["reported_tokens"]) == (415, 400)
    assert audit["ratio"] == 1.0375 and (audit["ratio_min"], audit["ratio_max"]) == (0.8, 1.1)
