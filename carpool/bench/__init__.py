"""Load generation, serving metrics (vLLM ``bench serve`` definitions), diagnose and reports.

datasets   request sets: workload JSONL, random lengths, shared-prefix groups
arrivals   Poisson / gamma (burstiness) arrival schedules
loadgen    LoadClient over the client's backends (http_load_client, engine_load_client), run_benchmark
metrics    compute_metrics / result_json with vLLM's field names
report     HTML report with PNG plots
diagnose   Diagnoser: serial vs concurrent vs fresh connections, /metrics, verdict
"""
