"""carpool: large batches of LLM work at the highest throughput the hardware allows."""

__version__ = "0.1.0"
