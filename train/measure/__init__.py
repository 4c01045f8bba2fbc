"""What a run reports and how drafters are measured: metrics, held-out estimates and comparisons."""
