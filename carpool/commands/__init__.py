"""One module per verb of the ``carpool`` command: its flags and everything it prints.

Each module exposes ``add_arguments(parser)`` and ``main(args) -> int`` (the exit code);
``carpool/cli.py`` imports only the module of the verb being run.  The library packages
below (jobs, client, server, bench, tune, distributed, cache) neither parse arguments
nor print: they take typed options and return values, and the command says them.
"""
