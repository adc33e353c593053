"""What a job tells its user, during the run and after it.

``stats.JobStats``: the statistics, in bounded memory; ``progress``: the live bar;
``prompt_reuse``: the prompt tokens the servers said they served from their prefix cache;
``answers``: what the answers say (why they stopped, the labels, parse errors);
``html_report``: the ``--report`` page; ``exit_codes``: the exit code a script reads.
"""
