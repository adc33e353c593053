"""What a job writes besides its journal's lines.

``table``: a Parquet or CSV ``-o`` written from the journal at the end; ``lock``: one run
at a time per output file; ``structured``: the JSON answer a task asked for, parsed and
checked against its schema for the output line.
"""
