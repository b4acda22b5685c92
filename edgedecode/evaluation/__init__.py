"""Measuring what a KV handoff costs in quality: teacher-forced perplexity and KL, needle retrieval,
and the deployment-time probe built on them."""
