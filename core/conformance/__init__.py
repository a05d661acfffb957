"""The backend conformance suite: any platform, built-in or plugin, runs it
against itself (``paged conformance --device X``). See docs/adding-a-platform.md."""

from paged.core.conformance.runner import Check, CheckResult, Report, Skip, run_suite

__all__ = ["Check", "CheckResult", "Report", "Skip", "run_suite"]
